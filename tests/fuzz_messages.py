"""Malformed upload bodies for tests/test_fuzz.py and tests/test_scored_validation.py (seeded by the caller's
random.Random): semantic_bad keeps the safetensors framing and breaks the content (dtypes, shapes, ranges,
metadata), framing_bad breaks the framing itself (header length, JSON, offsets, truncation, junk); st_blob writes a
safetensors blob that may lie."""
from __future__ import annotations

import json
import random
import struct

import numpy as np
from test_ref_server import MAX_SEQ, VOCAB

from common.wire.protocol import MAX_ROWS

_ST = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "F64": np.float64,
       "F32": np.float32, "F16": np.float16, "BOOL": np.bool_}


# --------------------------------------------------------------------------- message builders
def st_blob(tensors: dict, meta: dict | None = None, header_extra: dict | None = None,
            header_len: int | None = None) -> bytes:
    """A safetensors blob from numpy arrays, with optional header overrides (lies)."""
    header: dict = {}
    if meta is not None:
        header["__metadata__"] = meta
    parts, off = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(np.shape(arr)), "data_offsets": [off, off + len(raw)]}
        parts.append(raw)
        off += len(raw)
    for name, patch in (header_extra or {}).items():
        header.setdefault(name, {}).update(patch) if isinstance(patch, dict) else header.__setitem__(name, patch)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + b"".join(parts)


def meta(kind: str = "rollout", **over) -> dict:
    m = {"kind": kind, "protocol_version": "1", "policy_version": "0", "producer_id": "fuzz", "batch_id": "fz",
         "extra": "{}"}
    m.update(over)
    return m


def valid_arrays(rng: random.Random) -> dict:
    B, p, c = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 6)
    L = p + c + rng.randint(0, 3)
    ids = np.array([[rng.randrange(3, VOCAB) for _ in range(L)] for _ in range(B)], dtype=np.int64)
    return {"input_ids": ("I64", ids), "prompt_lens": ("I64", np.full(B, p, dtype=np.int64)),
            "completion_lens": ("I64", np.full(B, c, dtype=np.int64)),
            "advantages": ("F32", np.array([rng.uniform(-2, 2) for _ in range(B)], dtype=np.float32)),
            "gen_logps": ("F32", -np.abs(np.array([[rng.random() for _ in range(c)] for _ in range(B)],
                                                   dtype=np.float32)))}


def semantic_bad(rng: random.Random) -> bytes:
    """Well-framed safetensors whose content is wrong: dtypes, shapes, ranges, NaN/inf, metadata."""
    t = valid_arrays(rng)
    B, L = t["input_ids"][1].shape
    m = meta(batch_id=f"fz{rng.randrange(1 << 30)}")
    kind = rng.randrange(22)
    if kind == 0:  # float token ids
        t["input_ids"] = ("F32", t["input_ids"][1].astype(np.float32))
    elif kind == 1:  # a narrow / odd dtype anywhere
        name = rng.choice(list(t))
        dt = rng.choice(["I8", "U8", "I16", "F16", "F64", "BOOL"])
        t[name] = (dt, t[name][1].astype(_ST[dt]))
    elif kind == 2:  # wrong rank
        name = rng.choice(list(t))
        a = t[name][1]
        t[name] = (t[name][0], a.reshape((1,) + a.shape) if rng.random() < 0.5 else a.reshape(-1)[:1].reshape(()))
    elif kind == 3:  # per-token shape mismatch
        a = t["gen_logps"][1]
        t["gen_logps"] = ("F32", -np.ones((a.shape[0] + rng.choice([-1, 1, 2]) or 1, a.shape[1] + rng.randint(0, 3)),
                                          dtype=np.float32))
    elif kind == 4:  # NaN / inf
        name = rng.choice(["advantages", "gen_logps", "rewards"])
        bad = rng.choice([np.nan, np.inf, -np.inf])
        a = t.get(name, ("F32", np.zeros(B, dtype=np.float32)))[1].copy()
        a.reshape(-1)[rng.randrange(a.size)] = bad
        t[name] = ("F32", a)
    elif kind == 5:  # token ids out of range
        a = t["input_ids"][1].copy()
        a[rng.randrange(B), rng.randrange(L)] = rng.choice([VOCAB, VOCAB + 1, 2**31, 2**62, -1, -(2**63)])
        t["input_ids"] = ("I64", a)
    elif kind == 6:  # int32 ids beyond vocab
        t["input_ids"] = ("I32", np.full((B, L), rng.choice([VOCAB, 2**31 - 1, -(2**31)]), dtype=np.int32))
    elif kind == 7:  # lengths: zero, negative, beyond the row, huge
        name = rng.choice(["prompt_lens", "completion_lens"])
        t[name] = ("I64", np.full(B, rng.choice([0, -1, L, L + 1, 2**40, -(2**63), 2**63 - 1]), dtype=np.int64))
    elif kind == 8:  # rows disagree
        name = rng.choice(["prompt_lens", "completion_lens", "advantages", "rewards"])
        t[name] = ("F32" if name in ("advantages", "rewards") else "I64",
                   np.ones(B + rng.choice([1, 2, 7]), dtype=np.float32 if name in ("advantages", "rewards")
                           else np.int64))
    elif kind == 9:  # huge but real dimension: a row longer than the model's context
        n = rng.choice([MAX_SEQ + 1, 50_000, 120_000])
        t = {"input_ids": ("I64", np.ones((1, n), dtype=np.int64)), "prompt_lens": ("I64", np.array([1])),
             "completion_lens": ("I64", np.array([1])), "advantages": ("F32", np.zeros(1, dtype=np.float32))}
    elif kind == 10:  # too many rows / zero rows
        rows = rng.choice([0, MAX_ROWS + 1])
        t = {"input_ids": ("I64", np.ones((rows, 2), dtype=np.int64)), "prompt_lens": ("I64", np.ones(rows, np.int64)),
             "completion_lens": ("I64", np.ones(rows, np.int64)), "advantages": ("F32", np.zeros(rows, np.float32))}
    elif kind == 11:  # missing or unknown tensors
        if rng.random() < 0.5:
            t.pop(rng.choice(["input_ids", "prompt_lens", "completion_lens", "advantages"]))
        else:
            t[rng.choice(["ref_logps", "weights", "x" * 300, ""])] = ("F32", np.zeros(B, np.float32))
    elif kind == 12:  # positive logprobs
        t["gen_logps"] = ("F32", np.abs(t["gen_logps"][1]) + 0.5)
    elif kind == 13:
        m["protocol_version"] = rng.choice(["0", "3", "abc", "", "1.0", "9" * 400])
    elif kind == 14:
        m["kind"] = rng.choice(["scored", "", "ROLLOUT", "weights"])
    elif kind == 15:
        m["policy_version"] = rng.choice(["-1", "abc", "1e9", "", "0x10", "9" * 5000])
    elif kind == 16:
        m["extra"] = rng.choice(["[1, 2]", "not json", "[" * 100_000, '{"a": ' * 50_000, "null", '"s"', "{" * 3])
    elif kind == 17:
        m["batch_id"] = rng.choice(["", "x" * 70_000])
    elif kind == 18:
        m.pop(rng.choice(["protocol_version", "policy_version", "kind"]))
    elif kind == 19:  # no metadata at all
        m = None
    elif kind == 20:  # rewards of the wrong kind
        t["rewards"] = rng.choice([("I64", np.ones(B, np.int64)), ("F32", np.ones((B, 2), np.float32))])
    else:  # empty input_ids
        t["input_ids"] = ("I64", np.zeros((B, 0), np.int64))
    return st_blob(t, m)


def framing_bad(rng: random.Random) -> bytes:
    """Broken safetensors framing: header length lies, JSON damage, dtype/shape/offset lies, huge dims."""
    t = valid_arrays(rng)
    kind = rng.randrange(10)
    if kind == 0:
        return st_blob(t, meta(), header_len=rng.choice([0, 1, 7, 2**32, 2**63, 2**64 - 1, rng.randrange(1 << 20)]))
    if kind == 1:  # huge dimensions, little data
        shape = rng.choice([[2**31, 2**31], [2**62, 2], [-1, 4], [10**30], [0, 2**40]])
        return st_blob(t, meta(), header_extra={"input_ids": {"shape": shape}})
    if kind == 2:  # offsets out of range / overlapping / reversed
        offs = rng.choice([[0, 2**40], [50, 10], [-8, 8], [0, 0], ["a", "b"], [0], None])
        return st_blob(t, meta(), header_extra={rng.choice(list(t)): {"data_offsets": offs}})
    if kind == 3:  # unknown dtype string
        return st_blob(t, meta(), header_extra={"input_ids": {"dtype": rng.choice(["X", "", "I128", "F8_E4M3"])}})
    if kind == 4:  # header not an object / entries not objects
        h = rng.choice([b"[]", b"1", b'"x"', b"null", b'{"input_ids": 5}', b'{"__metadata__": 5}',
                        b'{"__metadata__": {"kind": 5}}'])
        return struct.pack("<Q", len(h)) + h
    if kind == 5:  # invalid UTF-8 / JSON in the header
        h = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
        return struct.pack("<Q", len(h)) + h + b"\0" * rng.randint(0, 64)
    if kind == 6:  # deep nesting in the header
        h = b"[" * rng.choice([1000, 100_000])
        return struct.pack("<Q", len(h)) + h
    blob = bytearray(st_blob(t, meta(batch_id=f"fz{rng.randrange(1 << 30)}")))
    if kind == 7:  # truncated
        return bytes(blob[:rng.randrange(len(blob))])
    if kind == 8:  # random byte flips
        for _ in range(rng.randint(1, 20)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        return bytes(blob)
    return bytes(blob) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))  # trailing junk
