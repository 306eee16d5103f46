"""Whole weights out of a ZeRO-3 model in bounded memory: publishing (trainer/publish.py) and saving
(trainer/checkpoint.py, trainer/lora/adapters.py) read every parameter, and under ZeRO-3 each rank holds only
its shard. Gathering them all at once costs every rank the whole model on top of training (+15 GB per GPU for
a 7B bf16 model, out of memory at ~30B), so they are gathered a group of about GATHER_BUCKET_MB at a time:
every rank gathers the group, rank 0 copies its tensors to CPU (in the publish/save dtype), the group is
released, the next one follows. Every rank walks the same groups in the same order (the gathers are
collectives). Under ZeRO-0/1/2 the parameters are whole already: one group, nothing gathered.

Why a constant rather than a knob: the group is transient GPU memory on top of training's own peak, and
256 MB is well under 1 % of any GPU that trains a model big enough for ZeRO-3, while the all-gathers it takes
(~60 for a 7B bf16 model) cost nothing next to moving the weights themselves; no setting of it would help a
run that the rest of training has not already put out of memory. A single tensor larger than the budget
(a 7B model's embedding: ~1 GB in bf16) is gathered alone, so the bound is max(budget, largest tensor).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

GATHER_BUCKET_MB = 256
GATHER_BUCKET_BYTES = GATHER_BUCKET_MB * 2**20


def gathered_bytes(p: torch.nn.Parameter) -> int:
    """What gathering p adds to a rank: its whole size (ZeRO-3 leaves p.numel() == 0 on a partitioned
    parameter), 0 for one ZeRO-3 keeps whole on every rank anyway (ds_persist: under the persistence threshold)."""
    if getattr(p, "ds_persist", False):
        return 0
    return int(getattr(p, "ds_numel", p.numel())) * p.element_size()


def groups(named: Iterable[tuple[str, torch.nn.Parameter]], budget: int) -> Iterator[list]:
    """Consecutive groups of (name, parameter) whose gathered bytes add up to at most `budget` (a parameter over
    it forms a group of its own). Module order keeps a layer's parameters together."""
    group, size = [], 0
    for name, p in named:
        b = gathered_bytes(p)
        if group and size + b > budget:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += b
    if group:
        yield group


def gathered_groups(named: Iterable[tuple[str, torch.nn.Parameter]], zero_stage: int,
                    budget: int = GATHER_BUCKET_BYTES) -> Iterator[list]:
    """Yields groups of (name, parameter) that are whole on every rank while the caller handles them: under
    ZeRO-3 each group is gathered when it is yielded and released (partitioned again) when the next is asked
    for. Called on every rank, each walking the whole iterator. Parameters must be distinct (no tied aliases)."""
    named = list(named)
    if zero_stage != 3:
        yield named
        return
    import deepspeed

    for group in groups(named, budget):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            yield group


def _cpu_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    out = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.detach().to(device="cpu", dtype=out, copy=True)  # copy: never alias a live CPU parameter


def cpu_copies(named: Iterable[tuple[str, torch.nn.Parameter]], zero_stage: int, rank: int,
               dtype: torch.dtype | None = None, budget: int = GATHER_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
    """Rank 0: {name: CPU copy} of the named parameters, floating ones in `dtype` (None: as they are), gathered a
    group at a time; None on the other ranks, which must call it too (they take part in the gathers).
    Names of one tied parameter (named_parameters(remove_duplicate=False)) share one copy, as they share memory
    in the model: it is gathered and copied once."""
    named = list(named)
    first: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for n, p in named:
        first.setdefault(id(p), (n, p))
    got: dict[str, torch.Tensor] = {}
    for group in gathered_groups(first.values(), zero_stage, budget):
        if rank == 0:
            for n, p in group:
                got[n] = _cpu_copy(p, dtype)
    if rank != 0:
        return None
    return {n: got[first[id(p)][0]] for n, p in named}


def state_copies(model: torch.nn.Module, zero_stage: int, rank: int, dtype: torch.dtype | None = None,
                 budget: int = GATHER_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
    """model.state_dict() as CPU copies on rank 0 (None elsewhere), floating tensors in `dtype`, the parameters
    gathered a group at a time; tied names (embeddings / lm_head) share one tensor, so save_pretrained writes
    it once, as from the live model."""
    params = cpu_copies(model.named_parameters(remove_duplicate=False), zero_stage, rank, dtype, budget)
    if rank != 0:
        return None
    # keep_vars: the entries' names without reading a partitioned parameter; buffers are whole on every rank
    return {k: params[k] if k in params else _cpu_copy(v, dtype)
            for k, v in model.state_dict(keep_vars=True).items()}
