"""`padding_free: auto`: packed or padded forwards, from an estimate of the work both ways (issue 45).

    padded  rows sorted by length, `rows_per_forward` at a time, each padded to its longest row:
            linear work per padded token, attention over each row's full padded square (sdpa with a mask),
            the LM head over the padded completion positions
    packed  the real tokens only, attention per row (sum l_i^2 / 2, common/packed_attention.py), the head over the
            real completion positions, plus the packed kernel's attention: on CPU per-row calls (sum l_i^2 and a
            fixed cost per row and layer) or one padded call per pack, the cheaper; flex / flash varlen sum
            l_i^2 / 2; where no packed kernel applies (eager), the dense N x N mask over each pack

Work is in multiply-adds of the model's own shapes (hidden, heads, KV heads, MLP, vocabulary, layers), so the
choice is per model and per batch; the per-call cost is per device (CPU: packed_attention.SEGMENT_CALL_FLOPS).
The ranks sum
their estimates first (`reduce`), so every ZeRO-3 rank makes the same choice (its module calls must match).
bench/packing.py measures the choice against both paths at the shapes users run (docs/benchmarks.md).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from common.packed_attention import cpu_kernel, packed_kernel
from common.packing import pack_plan


def _dims(model: torch.nn.Module) -> tuple[float, float, float, int]:
    """(linear work per token, attention work per (query, key) pair, head work per position, layers)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h, layers = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    hd = getattr(c, "head_dim", None) or h // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * hd
    f = getattr(c, "intermediate_size", None) or 4 * h
    per_token = layers * 2 * (h * (2 * heads * hd + 2 * kv) + 3 * h * f)
    return per_token, layers * 4 * heads * hd, 2 * h * c.vocab_size, layers


def work(model: torch.nn.Module, prompt_lens: torch.Tensor, completion_lens: torch.Tensor, rows_per_forward: int,
         pack_tokens: int | None) -> tuple[float, float]:
    """(packed, padded) estimated work of the forwards over these rows."""
    per_token, per_pair, per_head, layers = _dims(model)
    pl, cl = prompt_lens.cpu().double(), completion_lens.cpu().double()
    lens = pl + cl
    order = torch.argsort(lens, stable=True)
    padded = 0.0
    for s in range(0, lens.numel(), max(1, rows_per_forward)):
        g = order[s:s + rows_per_forward]
        b, L, T = g.numel(), float(lens[g].max()), float(cl[g].max())
        padded += b * L * per_token + b * L * L * per_pair + b * T * per_head
    packed = float(lens.sum()) * per_token + float(cl.sum()) * per_head
    kernel = packed_kernel(model)
    if kernel is None:  # transformers' dense block-diagonal mask over each pack
        packed += sum(float(lens[g].sum()) ** 2 for g in pack_plan(prompt_lens.cpu(), completion_lens.cpu(),
                                                                  pack_tokens)) * per_pair
    elif kernel == "segments":  # CPU: per-row calls or one padded call per pack, the cheaper (packed_attention)
        packed += sum(cpu_kernel([int(n) for n in lens[g]], per_pair, layers)[1]
                      for g in pack_plan(prompt_lens.cpu(), completion_lens.cpu(), pack_tokens))
    else:  # block-sparse / varlen kernels skip the blocks above the diagonal
        packed += float((lens * lens).sum()) / 2 * per_pair
    return packed, padded


def choose_packed(setting: str | bool, model: torch.nn.Module, prompt_lens: torch.Tensor,
                  completion_lens: torch.Tensor, rows_per_forward: int, pack_tokens: int | None = None,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """The padding_free knob for these rows: true / false as set; auto: packed when its estimated work is the
    smaller. reduce(t): sums a float64 tensor over the ranks in place (every rank then decides alike)."""
    s = str(setting).lower()
    if s in ("true", "false"):
        return s == "true"
    if s != "auto":
        raise ValueError(f"padding_free must be auto, true or false, got {setting!r}")
    both = torch.tensor(work(model, prompt_lens, completion_lens, rows_per_forward, pack_tokens),
                        dtype=torch.float64)
    if reduce is not None:
        reduce(both)
    return bool(both[0] < both[1])
