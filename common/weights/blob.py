"""The weights' wire form: one safetensors blob (named tensors, tied weights once, never pickled) carrying the
XXH3-64 checksum of its data section in `__metadata__["xxh3"]`; ParametersBody streams it without building
it in memory, verify_blob / tensors_from_blob check and read one. common/weights/sync.py moves them."""
from __future__ import annotations

import json

import torch

from common.weights.checksum import KEY, checksum, hasher

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",  # ints: deltas
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.uint16: "U16", torch.uint8: "U8"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


class ParametersBody:
    """Every named parameter (tied ones once) as the bytes of one standard safetensors file, in pieces.

    An iterable with a length: requests sends it with a Content-Length, piece by piece, straight
    from the parameters' memory (CPU float32 parameters are not even copied). Weights are hundreds
    of MB, and a joined blob costs a fresh allocation of that size plus a copy on every publish.
    """

    def __init__(self, model: torch.nn.Module | None, dtype: torch.dtype | None = None, named=None,
                 metadata: dict[str, str] | None = None, crc: str | None = None) -> None:
        """dtype: send floating parameters in this dtype (e.g. bfloat16 for bf16 workers: half the bytes);
        each is cast while it is sent, one at a time, so no cast copy of the whole model is held.
        named: (name, tensor) pairs to send instead of every parameter (LoRA adapters only, trainer/lora/adapters.py),
        described by `metadata` (the safetensors header's __metadata__). crc: the data's checksum when the caller
        already has it (common/weights/delta.py DeltaEncoder), saving a pass."""
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.items, offset = [], 0
        for name, p in (model.named_parameters() if named is None else named):
            t = p.detach()
            out = dtype if dtype is not None and t.is_floating_point() else t.dtype
            nbytes = t.numel() * out.itemsize
            header[name] = {"dtype": _DTYPES[out], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
            self.items.append((t, out))
            offset += nbytes
        if crc is None:
            h = hasher()
            for piece in self._pieces():  # one pass before sending (~15 GB/s): the header carries the checksum
                h.update(piece)
            crc = h.hexdigest()
        header["__metadata__"] = {"format": "pt", **header.get("__metadata__", {}), KEY: crc}
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        self.head = len(h).to_bytes(8, "little") + h
        self.size = len(self.head) + offset

    def __len__(self) -> int:
        return self.size

    def _pieces(self):
        for t, out in self.items:
            t = t.contiguous().cpu().to(out)  # CPU parameters already in `out`: no copy at all
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())  # any dtype (bf16 too) as bytes; keeps t

    def __iter__(self):  # a fresh pass each time: a retried request sends it all again
        yield self.head
        yield from self._pieces()

    def write_to(self, f) -> None:
        for piece in self:
            f.write(piece)


def parameters_blob(model: torch.nn.Module) -> bytes:
    """The same safetensors bytes as one blob (tests and the benchmark's file baseline)."""
    return b"".join(ParametersBody(model))


class IntegrityError(ValueError):
    """A weights blob that is truncated, corrupted or carries no checksum: never loaded."""


def verify_blob(buf: bytes | bytearray) -> dict:
    """Check a blob's framing and its xxh3 checksum (from the header) against its data; returns the header."""
    if len(buf) < 8:
        raise IntegrityError(f"weights blob of {len(buf)} bytes is too short")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n > len(buf) - 8:
        raise IntegrityError("weights blob: header length beyond the end (truncated?)")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise IntegrityError(f"weights blob: header is not JSON ({e})") from None
    want = (header.get("__metadata__") or {}).get(KEY) if isinstance(header, dict) else None
    if not want:
        raise IntegrityError("weights blob carries no xxh3 checksum in its header")
    data_len = len(buf) - 8 - n
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if end != data_len:
        raise IntegrityError(f"weights blob: data section has {data_len} bytes, the header describes {end}")
    got = checksum(memoryview(buf)[8 + n:])
    if got != want:
        raise IntegrityError(f"weights blob: xxh3 {got} does not match the header's {want} (corrupted)")
    return header


def tensors_from_blob(buf: bytes | bytearray, verify: bool = True) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views into a safetensors blob, in data order (checked: checksum, dtypes, shapes and
    offsets in range). verify=False skips the checksum pass (the ref server's own copy, updated in place)."""
    n = int.from_bytes(bytes(buf[:8]), "little")
    header = verify_blob(buf) if verify else json.loads(bytes(buf[8:8 + n]))
    base, data_len, out = 8 + n, len(buf) - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _FROM_NAME.get(info.get("dtype"))
        start, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= int(d)
        if dtype is None or not 0 <= start <= end <= data_len or (end - start) != numel * dtype.itemsize:
            raise ValueError(f"weights blob: tensor {name!r} has a bad dtype, shape or offsets")
        t = (torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + start) if numel
             else torch.empty(0, dtype=dtype))
        out.append((start, name, t.reshape(info["shape"])))
    return {name: t for _, name, t in sorted(out, key=lambda x: x[0])}


def blob_metadata(buf: bytes | bytearray) -> dict[str, str]:
    """The safetensors `__metadata__` of a blob ({} when it has none)."""
    n = int.from_bytes(bytes(buf[:8]), "little")
    if len(buf) < 8 or n > len(buf) - 8:
        raise ValueError("weights blob: bad header length")
    meta = json.loads(bytes(buf[8:8 + n])).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("weights blob: __metadata__ must be an object")
    return meta
