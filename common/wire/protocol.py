"""Wire protocol: rollout and scored batches as safetensors messages (see docs/protocol.md).

A message is one safetensors blob: named tensors plus a string->string metadata header.
safetensors is a plain header + raw bytes format, so decoding client bytes can never run
code (unlike pickle / torch.load). `decode_*` validates everything a peer could get wrong
and raises ProtocolError with a message that says what.

The batches themselves are common/wire/batch.py, their limits and validation common/wire/limits.py; this module
is the wire's one face and re-exports them (`from common.wire.protocol import RolloutBatch, ProtocolError`).
The optional `loss_mask` (B, T) bool (protocol version 2) says which completion tokens train: 1 = sampled by
the policy, 0 = a tool turn's token (in the sequence, scored by the reference, out of the loss). Absent = all ones.
"""
from __future__ import annotations

import json
import struct
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from common.wire.batch import RolloutBatch, ScoredBatch, collate
from common.wire.limits import (
    _MASK,
    MAX_META_CHARS,
    MAX_ROWS,
    MAX_SEQ_LEN,
    ProtocolError,
    _check_tensor,
    validate_batch,
)

__all__ = ["CONTENT_TYPE", "MAX_META_CHARS", "MAX_ROWS", "MAX_SEQ_LEN", "PROTOCOL_VERSION", "ProtocolError",
           "RolloutBatch", "ScoredBatch", "collate", "decode_rollout", "decode_scored", "encode_rollout",
           "encode_scored", "validate_batch", "PROTOCOL_VERSIONS", "LOSS_MASK_VERSION"]

PROTOCOL_VERSION = 2   # the newest version this side speaks
# Versions a decoder accepts. An encoder writes the lowest that can carry the message: 1 without a loss_mask (so a
# mask-free batch stays readable by version-1 peers), 2 with one (a version-1 peer then refuses it by its version,
# never by silently training tool tokens). A version-1 message carrying a loss_mask is refused.
PROTOCOL_VERSIONS = (1, 2)
LOSS_MASK_VERSION = 2
CONTENT_TYPE = "application/vnd.grpo.safetensors"


def _encode(b: RolloutBatch, kind: str, extra_tensors: dict) -> bytes:
    tensors = {
        "input_ids": b.input_ids.to(torch.int64).contiguous(),
        "prompt_lens": b.prompt_lens.to(torch.int64).contiguous(),
        "completion_lens": b.completion_lens.to(torch.int64).contiguous(),
        "advantages": b.advantages.to(torch.float32).contiguous(),
    }
    for name in ("gen_logps", "rewards"):
        t = getattr(b, name)
        if t is not None:
            tensors[name] = t.to(torch.float32).contiguous()
    tensors.update({k: v.to(torch.float32).contiguous() for k, v in extra_tensors.items() if v is not None})
    if b.loss_mask is not None:  # sent whenever present (also all ones): decode gives back what was encoded
        tensors["loss_mask"] = b.loss_mask.to(torch.bool).contiguous()
    meta = {
        "kind": kind,
        "protocol_version": str(1 if b.loss_mask is None else LOSS_MASK_VERSION),
        "policy_version": str(int(b.policy_version)),
        "producer_id": str(b.producer_id),
        "batch_id": str(b.batch_id),
        "extra": json.dumps({**b.extra, **b.control_extra()}, separators=(",", ":")),
    }
    return _serialize(tensors, meta)


_ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.float32: "F32", torch.bool: "BOOL"}


def _serialize(tensors: dict, meta: dict) -> bytes:
    """Write a standard safetensors blob (8-byte LE header length, JSON header, raw LE data).

    Written here rather than with safetensors.torch.save, whose Python-side bookkeeping (shared
    storage detection, ctypes copies) cost more than everything else in encode for a typical
    group. Decoding still goes through the safetensors parser, and the tests check that
    safetensors reads these blobs back bit for bit.
    """
    header: dict = {"__metadata__": meta}
    blobs, offset = [], 0
    for name, t in tensors.items():
        arr = t.detach().cpu().contiguous().numpy()
        if sys.byteorder == "big":
            arr = arr.byteswap()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        blobs.append(memoryview(arr.reshape(-1).view("u1")))  # no copy yet: join copies each tensor once
        offset += arr.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # data section 8-byte aligned, as safetensors writes it
    return b"".join([struct.pack("<Q", len(h)), h, *blobs])


def encode_rollout(b: RolloutBatch) -> bytes:
    validate_batch(b)
    return _encode(b, "rollout", {})


def encode_scored(b: ScoredBatch) -> bytes:
    validate_batch(b)
    return _encode(b, "scored", {"ref_logps": b.ref_logps})


def _load(data: bytes) -> tuple[dict, dict]:
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < 8:
        raise ProtocolError("message too short to be a safetensors blob")
    header_len = int.from_bytes(bytes(data[:8]), "little")
    if header_len > len(data) - 8:
        raise ProtocolError(f"header length field ({header_len}) exceeds message size ({len(data)})")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # deep nesting -> RecursionError
        raise ProtocolError(f"header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    meta = header.get("__metadata__") or {}
    try:
        tensors = st_load(bytes(data))
    except (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise ProtocolError(f"not a valid safetensors message: {e}") from e
    return tensors, meta


def _meta_int(meta: dict, key: str) -> int:
    try:
        return int(meta[key])
    except KeyError:
        raise ProtocolError(f"metadata field {key!r} missing") from None
    except ValueError:
        raise ProtocolError(f"metadata field {key!r} is not an integer: {meta[key][:40]!r}") from None


def _decode(data: bytes, kind: str) -> dict:
    tensors, meta = _load(data)
    version = _meta_int(meta, "protocol_version")
    if version not in PROTOCOL_VERSIONS:
        speaks = ", ".join(map(str, PROTOCOL_VERSIONS))
        raise ProtocolError(f"unknown protocol version {version} (this side speaks {speaks})")
    if meta.get("kind") != kind:
        raise ProtocolError(f"expected a {kind!r} message, got {meta.get('kind')!r}")
    allowed = {"input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps", "rewards", "loss_mask"}
    if kind == "scored":
        allowed.add("ref_logps")
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ProtocolError(f"unknown tensor(s) {unknown}")
    if "loss_mask" in tensors and version < LOSS_MASK_VERSION:
        raise ProtocolError(f"'loss_mask' needs protocol_version {LOSS_MASK_VERSION}, the message says {version}")
    for key in ("producer_id", "batch_id", "extra"):
        if len(meta.get(key, "")) > MAX_META_CHARS:
            raise ProtocolError(f"metadata field {key!r} too long")
    try:
        extra = json.loads(meta.get("extra") or "{}")
    except (json.JSONDecodeError, RecursionError) as e:  # deep nesting -> RecursionError
        raise ProtocolError(f"metadata 'extra' is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ProtocolError("metadata 'extra' must be a JSON object")
    fields = {name: tensors.get(name) for name in allowed}
    lm = fields["loss_mask"]
    if lm is not None:  # BOOL as encode writes it, or U8 from a producer without bool tensors; bytes must be 0/1
        _check_tensor("loss_mask", lm, _MASK, 2)
        if lm.numel() and int(lm.view(torch.uint8).max()) > 1:
            raise ProtocolError("'loss_mask' has values other than 0 and 1")
        fields["loss_mask"] = lm.to(torch.bool)
    fields.update(policy_version=_meta_int(meta, "policy_version"), producer_id=meta.get("producer_id", ""),
                  batch_id=meta.get("batch_id", ""), extra=extra)
    return fields


def decode_rollout(data: bytes, vocab_size: int | None = None, max_seq_len: int | None = None) -> RolloutBatch:
    b = RolloutBatch(**_decode(data, "rollout"))
    validate_batch(b, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return b


def decode_scored(data: bytes) -> ScoredBatch:
    b = ScoredBatch(**_decode(data, "scored"))
    validate_batch(b)
    return b
