"""Applying a delta (common/weights/delta.py makes them): check every part against the copy it updates before
a byte changes (plan_delta), write it in place (apply_plan), and keep the full copy a follower holds
(HeldWeights), whose checksum after a delta must be the trainer's."""
from __future__ import annotations

import numpy as np
import torch

from common.weights.delta import BLOCK, DeltaError, as_bits, each_then_checksum
from common.weights.kernels import apply_mask, apply_positions, warm_soon

_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)  # set bits per mask byte


def _split(key: str) -> tuple[str, str]:
    name, _, part = key.rpartition(":")
    return (name, part) if name and part in ("blk", "off", "mask", "val") else (key, "full")


def _positions(name: str, blk: torch.Tensor, off: torch.Tensor, n: int, nvals: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block counts and in-block offsets, checked so that every position they make is inside the tensor
    and every value is used once (the compiled writer has no bounds checks): (counts, offsets)."""
    blocks = -(-n // BLOCK)
    if blk.dtype != torch.int32 or blk.shape != (blocks,) or off.dtype != torch.uint16 or off.dim() != 1:
        raise DeltaError(f"{name}: positions {blk.dtype} {tuple(blk.shape)} / {off.dtype} {tuple(off.shape)}, "
                         f"want int32 ({blocks},) counts and uint16 offsets")
    counts, offsets = blk.numpy(), off.numpy()
    total = int(counts.sum(dtype=np.int64))
    if (counts < 0).any() or total != len(offsets) or len(offsets) != nvals:
        raise DeltaError(f"{name}: block counts sum to {total}, {len(offsets)} offsets and {nvals} values sent")
    last = n - (blocks - 1) * BLOCK  # every block but the last is whole: any uint16 offset is inside it
    if blocks and counts[-1] and int(offsets[len(offsets) - int(counts[-1]):].max()) >= last:
        raise DeltaError(f"{name}: a position is outside 0..{n - 1}")
    return counts, offsets


def plan_delta(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> list[tuple]:
    """Check a decoded delta against the copy it updates; returns the steps `apply_plan` takes.

    Everything a corrupt or foreign delta could get wrong is caught here, before any byte changes:
    unknown names, shapes, dtypes, positions out of range, value counts that do not match."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, part = _split(key)
        parts.setdefault(name, {})[part] = t
    steps = []
    for name, p in parts.items():
        b = base.get(name)
        if b is None:
            raise DeltaError(f"delta names {name!r}, which the weights do not have")
        if not b.is_contiguous():  # written through a flat view of its memory
            raise DeltaError(f"{name}: the weights it applies to are not contiguous")
        n = b.numel()
        kinds = sorted(p)
        if kinds == ["full"]:
            t = p["full"]
            if tuple(t.shape) != tuple(b.shape) or t.dtype != b.dtype:
                raise DeltaError(f"{name}: full tensor {t.dtype} {tuple(t.shape)}, weights {b.dtype} {tuple(b.shape)}")
            steps.append((name, "full", t, None))
            continue
        if kinds not in (["blk", "off", "val"], ["mask", "val"]):
            raise DeltaError(f"{name}: delta parts {kinds} (want blk+off+val, mask+val or the full tensor)")
        val = p["val"]
        if val.dim() != 1 or val.dtype != b.dtype:
            raise DeltaError(f"{name}: values {val.dtype} {tuple(val.shape)}, weights are {b.dtype}")
        if "blk" in p:
            steps.append((name, "idx", _positions(name, p["blk"], p["off"], n, len(val)), val))
        else:
            mask = p["mask"]
            if mask.dtype != torch.uint8 or mask.dim() != 1 or len(mask) != (n + 7) // 8:
                raise DeltaError(f"{name}: bitmask {mask.dtype} {tuple(mask.shape)}, want {(n + 7) // 8} bytes")
            m = mask.numpy()
            if n % 8 and int(m[-1]) >> (n % 8):
                raise DeltaError(f"{name}: bitmask has bits set past the tensor's {n} elements")
            selected = int(_POPCOUNT[m].sum())
            if selected != len(val):
                raise DeltaError(f"{name}: bitmask selects {selected} elements, {len(val)} values sent")
            steps.append((name, "mask", m, val))
    return steps


def apply_plan(base: dict[str, torch.Tensor], steps: list[tuple]) -> list[str]:
    """Write a checked delta into `base` in place; returns the names of the tensors that changed."""
    with torch.no_grad():
        for name, kind, a, val in steps:
            t = base[name]
            if kind == "full":
                t.copy_(a)
                continue
            bits, vals = as_bits(t).numpy(), as_bits(val).numpy()
            if kind == "idx":
                apply_positions(bits, a[0], a[1], vals)  # common/weights/kernels.py: one pass, no temporaries
            else:
                apply_mask(bits, a, vals)
    return [s[0] for s in steps]


class HeldWeights:
    """The full weights a follower last received (views into that blob, in its order), so a delta has
    something to apply to: the ref server's copy, or a worker's copy next to its engine's."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int, crc: str, in_model: bool = False) -> None:
        self.tensors, self.version, self.crc, self.in_model = tensors, version, crc, in_model
        warm_soon(t.element_size() for t in tensors.values())  # compiled by the first delta, off this path

    def adopt(self, model: torch.nn.Module) -> HeldWeights:
        """The same weights as the model's own parameters (just loaded from this copy), when they are CPU
        tensors of the same dtypes: deltas then apply in place there, and this copy's memory is freed."""
        params = dict(model.named_parameters())
        ok = set(params) == set(self.tensors) and all(p.device.type == "cpu" and p.dtype == self.tensors[n].dtype
                                                      and p.is_contiguous() for n, p in params.items())
        if not ok:
            return self
        return HeldWeights({n: params[n].data for n in self.tensors}, self.version, self.crc, in_model=True)

    def apply(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], version: int) -> list[str]:
        """Apply a delta (already checksum-checked as a blob) in place; returns the changed names.

        Raises DeltaError, before changing anything, for a delta on another base; after, when the result's
        checksum is not the trainer's (the copy is then unusable: the caller drops it and fetches a full one)."""
        base = metadata.get("base_version", "")
        if not base.isdigit() or int(base) != self.version or metadata.get("base_xxh3") != self.crc:
            raise DeltaError(f"delta for v{version} applies to v{base} (xxh3 {metadata.get('base_xxh3')}); "
                             f"this copy is v{self.version} (xxh3 {self.crc})")
        steps = {step[0]: step for step in plan_delta(self.tensors, tensors)}
        names = list(self.tensors)

        def write(i: int) -> None:
            if names[i] in steps:
                apply_plan(self.tensors, [steps[names[i]]])

        _, got = each_then_checksum(names, write, lambda i: self.tensors[names[i]])
        changed = list(steps)
        if got != metadata.get("full_xxh3"):
            raise DeltaError(f"weights rebuilt from the delta for v{version} have xxh3 {got}, the trainer's "
                             f"have {metadata.get('full_xxh3')}")
        self.version, self.crc = version, got
        return changed
