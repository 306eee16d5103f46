"""Delta weight sync: send only the elements that changed since the last published version (issue 25).

At RL learning rates most bf16 elements do not move from one step to the next (an Adam step of 1e-6 is
below half a bf16 rounding step for all but the smallest weights), so rank 0 keeps the last published
copy in the publish dtype and sends, per tensor, the cheapest of

    <name>:blk + <name>:off + <name>:val   positions: per block of 65536 elements how many changed (I32),
                              their offsets in the block (U16, block by block) and the new values
    <name>:mask + <name>:val  a bitmask (U8, element i = bit i % 8 of byte i // 8) and the new values
    <name>                    the whole tensor (when that is smaller still)

and nothing for a tensor that did not change. Elements are compared as bit patterns (the tensors viewed
as integers), so NaN, -0.0 and every other value round-trip exactly. The delta is one safetensors blob
(common/weights/blob.py ParametersBody: streamed, xxh3 checksum of its own data in the header) whose
`__metadata__` says format=weights_delta, base_version, base_xxh3 and full_xxh3: the xxh3 checksum of the full
blob's data section the delta reconstructs. Whoever applies it (the ref server to its full copy, a
worker to the copy it holds) checks everything before changing a byte, and the result against
full_xxh3 afterwards (common/weights/apply.py). Wire format: docs/protocol.md section 7.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from common.weights.checksum import hasher
from common.weights.kernels import BLOCK, scan, warm_soon  # BLOCK: positions go as 16-bit offsets within blocks of it

DELTA_FORMAT = "weights_delta"
# a delta over this share of the weights goes as the full copy: encoding and applying a bitmask delta costs
# more than a copy, which outweighs the bytes saved (bench/weight_sync.py)
DELTA_MAX_SHARE = 0.15
SAMPLE_CHUNKS, SAMPLE_LEN = 16, 1024  # the sample that decides between a delta and the full copy
# tensors encoded or applied at once (the kernels drop the GIL); past 4 the memory bus, not the cores, limits
THREADS = max(1, min(4, os.cpu_count() or 1))
NEEDS_FULL = "needs the full copy"  # in the ref server's 409 to a delta it cannot apply: the publisher sends one
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that does not fit the copy it is applied to (names, shapes, dtypes, positions): never applied."""


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers: equal bit patterns compare equal (NaN == NaN, -0.0 != 0.0)."""
    return t.reshape(-1).view(_AS_INT[t.element_size()])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def checksum_of(tensors) -> str:
    """The xxh3 checksum of the tensors' bytes back to back: a full blob's data section when given in its order."""
    h = hasher()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def each_then_checksum(names: list[str], work, tensor) -> tuple[list, str]:
    """work(i) for every i in range(len(names)), THREADS at a time (the kernels drop the GIL), and the xxh3
    checksum of tensor(0), tensor(1), ... back to back, each hashed as soon as its work is done (xxh3 drops the
    GIL too): (the results in order, the checksum). The first error is raised, the work not begun dropped."""
    h = hasher()
    with ThreadPoolExecutor(THREADS) as pool, ThreadPoolExecutor(1) as hashing:
        jobs = [pool.submit(work, i) for i in range(len(names))]
        try:
            results, done = [], None
            for i, job in enumerate(jobs):
                results.append(job.result())
                done = hashing.submit(h.update, tensor_bytes(tensor(i)))
            if done is not None:
                done.result()
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
    return results, h.hexdigest()


def block_positions(counts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Flat positions (int64) from per-block counts and in-block offsets, the wire's positions encoding."""
    return np.repeat(np.arange(len(counts), dtype=np.int64) << 16, counts) | offsets.astype(np.int64)


def encode_tensor(name: str, new: torch.Tensor, old: torch.Tensor, expect: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The cheapest encoding of `new` against `old` (same shape and dtype, contiguous, CPU); [] if equal.
    `old` is then updated to `new`. expect: how many elements are expected to differ (sizes the buffers)."""
    a, b = as_bits(new).numpy(), as_bits(old).numpy()
    n, item = a.size, new.element_size()
    blocks = -(-n // BLOCK)
    counts, offsets, vals = scan(a, b, expect)  # b is now a (common/weights/kernels.py: one compiled pass)
    k = len(vals)
    if k == 0:
        return []
    sizes = {"full": n * item, "mask": (n + 7) // 8 + k * item, "pos": 4 * blocks + k * (2 + item)}
    kind = min(sizes, key=sizes.get)  # ties: full (first), then mask
    if kind == "full":
        return [(name, old)]  # the kept copy: it does not change before the next publish
    vals = torch.from_numpy(vals).view(new.dtype)
    if kind == "mask":  # over ~1/16 of the elements changed (a delta that large usually goes in full)
        changed = np.zeros(n, dtype=np.bool_)
        changed[block_positions(counts, offsets)] = True
        return [(f"{name}:mask", torch.from_numpy(np.packbits(changed, bitorder="little"))), (f"{name}:val", vals)]
    return [(f"{name}:blk", torch.from_numpy(counts)), (f"{name}:off", torch.from_numpy(offsets)),
            (f"{name}:val", vals)]


class DeltaEncoder:
    """Rank 0's last published copy (publish dtype, CPU) and the deltas against it.

    `snapshot(named)` takes a full copy (first publish, or after the server lost the chain);
    `delta(named)` returns the changed tensors' encodings and moves the copy to the new weights.
    Either way the copy ends equal to what was just published, and `crc` is its full blob checksum (xxh3)."""

    def __init__(self, dtype: torch.dtype | None = None, max_share: float | None = None) -> None:
        self.dtype = dtype
        self.max_share = max_share  # None: DELTA_MAX_SHARE
        self.last: dict[str, torch.Tensor] = {}
        self.crc: str | None = None
        self.delta_bytes = 0  # the last delta's data bytes (0 when it went in full)
        self.gave_up = False  # the last delta would be over DELTA_MAX_SHARE: the full copy goes instead
        self.estimate = 0.0  # the last delta's estimated share (estimate_share)
        self._expect: dict[str, int] = {}  # name -> elements expected to differ (estimate_share): buffer sizes

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        out = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
        return t.to(device="cpu", dtype=out).contiguous()

    def snapshot(self, named) -> list[tuple[str, torch.Tensor]]:
        """Keep a copy of every tensor in the publish dtype; returns it (what a full publish sends)."""
        self.last = {}
        for name, t in named:
            c = self._cast(t)
            self.last[name] = c.clone() if c.data_ptr() == t.data_ptr() else c  # never alias a live parameter
        self.crc = checksum_of(self.last.values())
        warm_soon(t.element_size() for t in self.last.values())
        return list(self.last.items())

    def delta(self, named) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
        """(encoded tensors, metadata) of what changed since the copy; the copy becomes the new weights."""
        if self.crc is None:
            raise RuntimeError("DeltaEncoder.delta before a snapshot")
        out, named = [], list(named)
        base_crc, self.delta_bytes = self.crc, 0
        # most of it changed: the full copy is cheaper for everyone (a bitmask delta costs more to encode and
        # apply than a copy), decided from a sample before any encoding
        self.estimate = self.estimate_share(named)
        self.gave_up = self.estimate > (DELTA_MAX_SHARE if self.max_share is None else self.max_share)

        def encode(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            old, new = self.last.get(name), self._cast(t)
            if old is None or old.shape != new.shape or old.dtype != new.dtype:
                raise DeltaError(f"{name}: not in the last published copy with this shape and dtype")
            if self.gave_up:  # going in full: no encoding, the copy just follows
                old.copy_(new)
                return []
            return encode_tensor(name, new, old, self._expect.get(name, 0))  # and `old` becomes `new`

        encoded, crc = each_then_checksum([name for name, _ in named], lambda i: encode(*named[i]),
                                          lambda i: self.last[named[i][0]])
        for enc in encoded:
            out += enc
            self.delta_bytes += sum(x.numel() * x.element_size() for _, x in enc)
        if self.gave_up:
            out = []
        missing = set(self.last) - {name for name, _ in named}
        if missing:
            raise DeltaError(f"tensors missing from this publish: {sorted(missing)[:5]}")
        self.crc = crc
        return out, {"format": DELTA_FORMAT, "base_xxh3": base_crc, "full_xxh3": self.crc}

    def estimate_share(self, named) -> float:
        """The delta's size as a share of the weights, estimated from SAMPLE_CHUNKS evenly spaced runs of
        SAMPLE_LEN elements per tensor (small tensors whole): a few MB read instead of the whole weights,
        through strided views (one transfer per tensor when the policy lives on a GPU)."""
        est, total = 0.0, 0
        for name, t in named:
            old = self.last.get(name)
            if old is None or old.numel() != t.numel():
                continue  # delta() says which
            new = self._cast(_sample(t.detach()))
            if new.dtype != old.dtype:
                continue  # delta() says which
            n, item, sample = old.numel(), old.element_size(), _sample(old)
            k = int((as_bits(new) != as_bits(sample)).sum())
            changed = k * n / sample.numel()
            self._expect[name] = int(changed)
            est += min(n * item, (n + 7) / 8 + changed * item, 4 * -(-n // BLOCK) + changed * (2 + item))
            total += n * item
        return est / max(total, 1)


def _sample(t: torch.Tensor) -> torch.Tensor:
    """SAMPLE_CHUNKS evenly spaced runs of SAMPLE_LEN elements of t (a view; t whole when it is small)."""
    flat = t.reshape(-1)
    n = flat.numel()
    if n <= SAMPLE_CHUNKS * SAMPLE_LEN:
        return flat
    step = (n - SAMPLE_LEN) // (SAMPLE_CHUNKS - 1)
    return flat.as_strided((SAMPLE_CHUNKS, SAMPLE_LEN), (step, 1), flat.storage_offset())
