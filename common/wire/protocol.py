"""Wire protocol: rollout and scored batches as safetensors messages (see docs/protocol.md).

A message is one safetensors blob: named tensors plus a string->string metadata header.
safetensors is a plain header + raw bytes format, so decoding client bytes can never run
code (unlike pickle / torch.load). `decode_*` validates everything a peer could get wrong
and raises ProtocolError with a message that says what.

Row i of `input_ids` is prompt_i followed by completion_i, right-padded to L. The
completion tokens of row i are input_ids[i, prompt_lens[i] : prompt_lens[i] + completion_lens[i]],
and per-token tensors (gen_logps, ref_logps) are (B, T) with T = max(completion_lens),
entry [i, j] belonging to completion token j of row i; entries past completion_lens[i] are 0.
"""
from __future__ import annotations

import json
import math
import struct
import sys
import uuid
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from common.wire.batch_extra import ExtraError, check_extra

PROTOCOL_VERSION = 1
CONTENT_TYPE = "application/vnd.grpo.safetensors"

# Hard limits that hold whatever the model: they bound what a decoder will allocate.
MAX_ROWS = 4096
MAX_SEQ_LEN = 1 << 17
MAX_META_CHARS = 64 * 1024


class ProtocolError(ValueError):
    """A message that is malformed, inconsistent or out of range. The text says what."""


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor                    # (B, L) int64: prompt + completion, right-padded
    prompt_lens: torch.Tensor                  # (B,) int64
    completion_lens: torch.Tensor              # (B,) int64
    advantages: torch.Tensor                   # (B,) float32
    gen_logps: torch.Tensor | None = None   # (B, T) float32, generation-time policy logprobs
    rewards: torch.Tensor | None = None     # (B,) float32, raw rewards (for metrics)
    policy_version: int = 0
    producer_id: str = ""
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extra: dict = field(default_factory=dict)  # small JSON-able metadata (e.g. reward components)
    # (B, T) bool, 1 = a token the policy sampled; 0 = a tool turn's token (in the sequence, out of the loss).
    # None = all ones (protocol-1 producers). Keyword-only, so it comes after every positional field, ScoredBatch's too.
    loss_mask: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_completion_len(self) -> int:
        return int(self.completion_lens.max())

    def completion_mask(self) -> torch.Tensor:
        """(B, T) bool from lengths, never from pad ids (pad may equal eos)."""
        t = torch.arange(self.max_completion_len, device=self.completion_lens.device)
        return t[None, :] < self.completion_lens[:, None]

    def num_completion_tokens(self) -> int:
        return int(self.completion_lens.sum())


@dataclass
class ScoredBatch(RolloutBatch):
    ref_logps: torch.Tensor | None = None   # (B, T) float32, reference-model logprobs (None when beta == 0)

    @classmethod
    def from_rollout(cls, rb: RolloutBatch, ref_logps: torch.Tensor | None) -> ScoredBatch:
        return cls(**{k: getattr(rb, k) for k in RolloutBatch.__dataclass_fields__}, ref_logps=ref_logps)


# ---------------------------------------------------------------------------------------
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
    meta = {
        "kind": kind,
        "protocol_version": str(PROTOCOL_VERSION),
        "policy_version": str(int(b.policy_version)),
        "producer_id": str(b.producer_id),
        "batch_id": str(b.batch_id),
        "extra": json.dumps(b.extra, separators=(",", ":")),
    }
    return _serialize(tensors, meta)


_ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.float32: "F32"}


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
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unknown protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    if meta.get("kind") != kind:
        raise ProtocolError(f"expected a {kind!r} message, got {meta.get('kind')!r}")
    allowed = {"input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps", "rewards"}
    if kind == "scored":
        allowed.add("ref_logps")
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ProtocolError(f"unknown tensor(s) {unknown}")
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


# ---------------------------------------------------------------------------------------
def _check_tensor(name: str, t, dtypes: tuple, ndim: int) -> None:
    if t is None:
        raise ProtocolError(f"tensor {name!r} missing")
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"{name!r} is not a tensor")
    if t.dtype not in dtypes:
        raise ProtocolError(f"{name!r} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.ndim != ndim:
        raise ProtocolError(f"{name!r} has {t.ndim} dimensions, expected {ndim}")


_INT = (torch.int64, torch.int32)
_FLOAT = (torch.float32,)


def _minmax(t: torch.Tensor) -> tuple:
    """(min, max) as Python numbers in one pass over t (non-empty); a NaN anywhere gives NaN for both."""
    lo, hi = torch.aminmax(t)
    return lo.item(), hi.item()


def _finite(lo: float, hi: float) -> bool:
    return math.isfinite(lo) and math.isfinite(hi)


def validate_batch(b: RolloutBatch, vocab_size: int | None = None, max_seq_len: int | None = None) -> None:
    """Raise ProtocolError unless every tensor has the right dtype, rank, shape and range.

    One min/max pass per tensor (torch.aminmax) answers all of its range checks: finite iff
    min and max are finite (NaN propagates), lengths from their extremes, logprob sign from max.
    """
    _check_tensor("input_ids", b.input_ids, _INT, 2)
    _check_tensor("prompt_lens", b.prompt_lens, _INT, 1)
    _check_tensor("completion_lens", b.completion_lens, _INT, 1)
    _check_tensor("advantages", b.advantages, _FLOAT, 1)
    B, L = b.input_ids.shape
    if not 1 <= B <= MAX_ROWS:
        raise ProtocolError(f"batch has {B} rows; allowed 1..{MAX_ROWS}")
    limit = min(MAX_SEQ_LEN, max_seq_len or MAX_SEQ_LEN)
    if L > limit:
        raise ProtocolError(f"sequence length {L} exceeds the limit {limit}")
    for name in ("prompt_lens", "completion_lens", "advantages"):
        if getattr(b, name).shape[0] != B:
            raise ProtocolError(f"{name!r} has {getattr(b, name).shape[0]} entries for {B} rows")
    p_min, p_max = _minmax(b.prompt_lens)
    c_min, c_max = _minmax(b.completion_lens)
    if p_min < 1:
        raise ProtocolError("every prompt length must be >= 1")
    if c_min < 1:
        raise ProtocolError("every completion length must be >= 1")
    # Python ints: no overflow. Each length alone first, then the per-row sum only when the
    # extremes alone could exceed L.
    if p_max > L or c_max > L or (p_max + c_max > L and int((b.prompt_lens + b.completion_lens).max()) > L):
        raise ProtocolError(f"prompt_len + completion_len exceeds the row length {L}")
    if max_seq_len is not None and p_max >= max_seq_len:
        raise ProtocolError(f"prompt length {p_max} >= the model's sequence length {max_seq_len}")
    id_min, id_max = _minmax(b.input_ids)
    if id_min < 0:
        raise ProtocolError("negative token id")
    if vocab_size is not None and id_max >= vocab_size:
        raise ProtocolError(f"token id {id_max} >= vocab size {vocab_size}")
    if not _finite(*_minmax(b.advantages)):
        raise ProtocolError("advantages contain NaN or inf")
    T = c_max
    per_token = ["gen_logps"] + (["ref_logps"] if isinstance(b, ScoredBatch) else [])
    for name in per_token:
        t = getattr(b, name)
        if t is None:
            continue
        _check_tensor(name, t, _FLOAT, 2)
        if tuple(t.shape) != (B, T):
            raise ProtocolError(f"{name!r} has shape {tuple(t.shape)}, "
                                f"expected ({B}, {T}) = (rows, max completion len)")
        lo, hi = _minmax(t)
        if not _finite(lo, hi):
            raise ProtocolError(f"{name!r} contains NaN or inf")
        if hi > 1e-3:
            raise ProtocolError(f"{name!r} has positive log-probabilities (max {hi:.4g})")
    if b.rewards is not None:
        _check_tensor("rewards", b.rewards, _FLOAT, 1)
        if b.rewards.shape[0] != B or not _finite(*_minmax(b.rewards)):
            raise ProtocolError("'rewards' must be B finite values")
    if not isinstance(b.policy_version, int) or b.policy_version < 0:
        raise ProtocolError("policy_version must be a non-negative integer")
    try:
        check_extra(b.extra, B)
    except ExtraError as e:
        raise ProtocolError(str(e)) from None


# ---------------------------------------------------------------------------------------
def _pad_cat(ts: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in ts], dim=0)


def collate(batches: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate batches row-wise (padding input_ids and per-token tensors with 0).

    The result has the type of the first batch; an optional tensor survives only if every
    batch has it. Metadata of the first batch is kept, `extra` lists are concatenated.
    """
    if not batches:
        raise ValueError("collate needs at least one batch")
    L = max(int(b.input_ids.shape[1]) for b in batches)
    T = max(b.max_completion_len for b in batches)
    kw = dict(
        input_ids=_pad_cat([b.input_ids for b in batches], L),
        prompt_lens=torch.cat([b.prompt_lens for b in batches]),
        completion_lens=torch.cat([b.completion_lens for b in batches]),
        advantages=torch.cat([b.advantages for b in batches]),
        policy_version=min(b.policy_version for b in batches),
        producer_id=batches[0].producer_id, batch_id=batches[0].batch_id,
    )
    names = ["gen_logps"] + (["ref_logps"] if isinstance(batches[0], ScoredBatch) else [])
    for name in names:
        ts = [getattr(b, name) for b in batches]
        kw[name] = _pad_cat(ts, T) if all(t is not None for t in ts) else None
    rs = [b.rewards for b in batches]
    kw["rewards"] = torch.cat(rs) if all(r is not None for r in rs) else None
    extra: dict = {}
    for b in batches:
        for k, v in b.extra.items():
            if isinstance(v, list):
                extra.setdefault(k, []).extend(v)
            elif isinstance(v, dict):  # e.g. reward components: dict of lists
                d = extra.setdefault(k, {})
                for kk, vv in v.items():
                    d.setdefault(kk, []).extend(vv if isinstance(vv, list) else [vv])
    kw["extra"] = extra
    return type(batches[0])(**kw)
