"""common.wire.protocol: exact round trips, and decode rejects every malformed message with ProtocolError."""
from __future__ import annotations

import json
import pickle
import random

import pytest
import torch
from safetensors.torch import save as st_save

from common.wire.protocol import (
    CONTENT_TYPE,
    MAX_META_CHARS,
    MAX_ROWS,
    PROTOCOL_VERSION,
    ProtocolError,
    RolloutBatch,
    ScoredBatch,
    collate,
    decode_rollout,
    decode_scored,
    encode_rollout,
    encode_scored,
    validate_batch,
)

VOCAB = 1000


# --- builders -------------------------------------------------------------------------
def make_rollout(prompt_lens=(3, 5, 1, 4), completion_lens=(6, 1, 9, 2), extra_width: int = 2, seed: int = 0,
                 gen_logps: bool = True, rewards: bool = True, **kw) -> RolloutBatch:
    """Ragged rows: prompt_i + completion_i, right-padded with 0 to max total + extra_width."""
    g = torch.Generator().manual_seed(seed)
    pl, cl = torch.tensor(prompt_lens), torch.tensor(completion_lens)
    B, T = len(prompt_lens), int(cl.max())
    L = int((pl + cl).max()) + extra_width
    ids = torch.zeros(B, L, dtype=torch.int64)
    logps = torch.zeros(B, T)
    for i in range(B):
        n = int(pl[i] + cl[i])
        ids[i, :n] = torch.randint(0, VOCAB, (n,), generator=g)
        logps[i, :int(cl[i])] = -torch.rand(int(cl[i]), generator=g) * 7
    r = torch.randn(B, generator=g)
    return RolloutBatch(input_ids=ids, prompt_lens=pl, completion_lens=cl, advantages=(r - r.mean()),
                        gen_logps=logps if gen_logps else None, rewards=r if rewards else None, **kw)


def make_scored(ref: bool = True, **kw) -> ScoredBatch:
    rb = make_rollout(**kw)
    ref_logps = None
    if ref:
        ref_logps = torch.zeros(rb.num_rows, rb.max_completion_len)
        gen = torch.Generator().manual_seed(7)
        ref_logps[rb.completion_mask()] = -torch.rand(rb.num_completion_tokens(), generator=gen)
    return ScoredBatch.from_rollout(rb, ref_logps)


def tensors_of(b: RolloutBatch) -> dict:
    names = ["input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps", "rewards"]
    if isinstance(b, ScoredBatch):
        names.append("ref_logps")
    return {n: getattr(b, n).clone() for n in names if getattr(b, n) is not None}


def meta_of(kind: str = "rollout", **over) -> dict:
    m = {"kind": kind, "protocol_version": str(PROTOCOL_VERSION), "policy_version": "3", "producer_id": "p",
         "batch_id": "b", "extra": "{}"}
    m.update(over)
    return {k: v for k, v in m.items() if v is not None}


def raw(tensors: dict, kind: str = "rollout", **meta) -> bytes:
    """A message written straight with safetensors, bypassing encode's own validation."""
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta_of(kind, **meta))


def split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + body


def assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    assert type(a) is type(b)
    for name, t in tensors_of(a).items():
        u = getattr(b, name)
        assert u is not None, name
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), name
    for name in ("gen_logps", "rewards") + (("ref_logps",) if isinstance(a, ScoredBatch) else ()):
        assert (getattr(a, name) is None) == (getattr(b, name) is None), name
    assert (a.policy_version, a.producer_id, a.batch_id, a.extra) == (b.policy_version, b.producer_id,
                                                                      b.batch_id, b.extra)


# --- round trips ----------------------------------------------------------------------
EXTRA = {"reward_components": {"correct": [1.0, 0.0, 1.0, 0.5], "format": [0.1, 0.2, 0.3, 0.4]},
         "prompt": "What is 2 + 2? ünïcødé ✓", "nested": {"a": [1, {"b": None}], "t": True}}


@pytest.mark.parametrize("gen_logps", [True, False])
@pytest.mark.parametrize("rewards", [True, False])
@pytest.mark.parametrize("extra", [{}, EXTRA])
def test_rollout_round_trip(gen_logps, rewards, extra):
    b = make_rollout(gen_logps=gen_logps, rewards=rewards, extra=extra, policy_version=12, producer_id="worker-3")
    data = encode_rollout(b)
    assert isinstance(data, bytes)
    got = decode_rollout(data, vocab_size=VOCAB, max_seq_len=64)
    assert_same(b, got)
    assert_same(b, decode_rollout(encode_rollout(got)))  # and again (header key order may differ: JSON map)


@pytest.mark.parametrize("ref", [True, False])
@pytest.mark.parametrize("gen_logps", [True, False])
def test_scored_round_trip(ref, gen_logps):
    b = make_scored(ref=ref, gen_logps=gen_logps, extra=EXTRA, policy_version=5, producer_id="ref")
    got = decode_scored(encode_scored(b))
    assert_same(b, got)
    assert isinstance(got, ScoredBatch)


@pytest.mark.parametrize("pl,cl,pad", [((1,), (1,), 0), ((7,), (3,), 0), ((2, 9, 4), (11, 1, 5), 0),
                                       ((1, 1, 1, 1, 1), (1, 2, 3, 4, 5), 13)])
def test_ragged_lengths_round_trip(pl, cl, pad):
    b = make_scored(prompt_lens=pl, completion_lens=cl, extra_width=pad, seed=len(pl))
    assert_same(b, decode_scored(encode_scored(b)))
    assert tuple(b.ref_logps.shape) == (len(pl), max(cl))


def test_int32_inputs_are_sent_as_int64():
    b = make_rollout()
    b32 = RolloutBatch(b.input_ids.int(), b.prompt_lens.int(), b.completion_lens.int(), b.advantages,
                       gen_logps=b.gen_logps, batch_id=b.batch_id)
    got = decode_rollout(encode_rollout(b32))
    assert got.input_ids.dtype == torch.int64 and torch.equal(got.input_ids, b.input_ids)


def test_from_rollout_keeps_everything_and_collate_pads():
    a, b = make_scored(seed=1), make_scored(prompt_lens=(2,), completion_lens=(20,), seed=2)
    c = collate([a, b])
    assert isinstance(c, ScoredBatch) and c.num_rows == 5 and c.max_completion_len == 20
    assert torch.equal(c.ref_logps[:4, :a.max_completion_len], a.ref_logps)
    assert (c.ref_logps[:4, a.max_completion_len:] == 0).all()
    validate_batch(c)
    assert_same(c, decode_scored(encode_scored(c)))


def test_content_type_and_version():
    assert CONTENT_TYPE == "application/vnd.grpo.safetensors" and PROTOCOL_VERSION == 1
    header, _ = split(encode_rollout(make_rollout()))
    assert header["__metadata__"]["kind"] == "rollout"
    assert header["__metadata__"]["protocol_version"] == str(PROTOCOL_VERSION)
    assert {k: v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
        "input_ids": "I64", "prompt_lens": "I64", "completion_lens": "I64", "advantages": "F32",
        "gen_logps": "F32", "rewards": "F32"}


def test_messages_are_standard_safetensors(tmp_path):
    """What encode writes is read back bit for bit by the safetensors library itself."""
    from safetensors import safe_open
    from safetensors.torch import load as st_load

    b = make_scored(extra=EXTRA, policy_version=9, producer_id="w")
    data = encode_scored(b)
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0 and len(data) == 8 + n + sum(t.numel() * t.element_size() for t in tensors_of(b).values())
    loaded = st_load(data)
    assert loaded.keys() == tensors_of(b).keys()
    for k, t in tensors_of(b).items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t)
    (tmp_path / "m.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor("ref_logps"), b.ref_logps)
    assert meta == {"kind": "scored", "protocol_version": "1", "policy_version": "9", "producer_id": "w",
                    "batch_id": b.batch_id, "extra": json.dumps(EXTRA, separators=(",", ":"))}
    # and a blob written by safetensors.torch.save decodes the same
    assert_same(b, decode_scored(raw(tensors_of(b), kind="scored", policy_version="9", producer_id="w",
                                     batch_id=b.batch_id, extra=meta["extra"])))


def test_serializer_handles_any_tensor_shape():
    from safetensors.torch import load as st_load

    from common.wire.protocol import _serialize
    ts = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5), "ids": torch.arange(12).reshape(3, 4),
          "view": torch.randn(4, 6)[:, 1:5:2], "i32": torch.tensor([1, -2], dtype=torch.int32)}
    got = st_load(_serialize(ts, {"k": "v"}))
    for k, t in ts.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_encode_takes_non_contiguous_views():
    b = make_rollout()
    wide = torch.zeros(b.num_rows, b.input_ids.shape[1] * 2, dtype=torch.int64)
    wide[:, ::2] = b.input_ids
    v = RolloutBatch(wide[:, ::2], b.prompt_lens, b.completion_lens, b.advantages, gen_logps=b.gen_logps.t().t(),
                     batch_id=b.batch_id)
    assert not v.input_ids.is_contiguous()
    got = decode_rollout(encode_rollout(v))
    assert torch.equal(got.input_ids, b.input_ids) and torch.equal(got.gen_logps, b.gen_logps)
    part = RolloutBatch(b.input_ids[1:3], b.prompt_lens[1:3], b.completion_lens[1:3], b.advantages[1:3],
                        batch_id="x")  # views with a storage offset
    assert torch.equal(decode_rollout(encode_rollout(part)).input_ids, b.input_ids[1:3])


# --- rejections -----------------------------------------------------------------------
def expect(match: str, data: bytes, decoder=decode_rollout, **kw) -> None:
    with pytest.raises(ProtocolError, match=match):
        decoder(data, **kw)


def with_tensor(name, value, base=None, kind="rollout", **meta):
    t = tensors_of(base or (make_scored() if kind == "scored" else make_rollout()))
    if value is None:
        t.pop(name)
    else:
        t[name] = value
    return raw(t, kind=kind, **meta)


def test_protocol_error_is_one_clear_type():
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize("name,value,match", [
    ("input_ids", torch.zeros(4, 12, dtype=torch.int16), "'input_ids' has dtype torch.int16"),
    ("input_ids", torch.zeros(4, 12, dtype=torch.float32), "'input_ids' has dtype torch.float32"),
    ("prompt_lens", torch.tensor([3., 5., 1., 4.]), "'prompt_lens' has dtype"),
    ("advantages", torch.zeros(4, dtype=torch.float64), "'advantages' has dtype torch.float64"),
    ("advantages", torch.zeros(4, dtype=torch.bfloat16), "'advantages' has dtype torch.bfloat16"),
    ("gen_logps", torch.zeros(4, 9, dtype=torch.float16), "'gen_logps' has dtype torch.float16"),
    ("rewards", torch.zeros(4, dtype=torch.int64), "'rewards' has dtype"),
    ("advantages", torch.zeros(4, dtype=torch.bool), "'advantages' has dtype torch.bool"),
])
def test_rejects_wrong_dtypes(name, value, match):
    expect(match, with_tensor(name, value))


@pytest.mark.parametrize("name,value,match", [
    ("input_ids", torch.zeros(48, dtype=torch.int64), "'input_ids' has 1 dimensions, expected 2"),
    ("input_ids", torch.zeros(1, 4, 12, dtype=torch.int64), "'input_ids' has 3 dimensions, expected 2"),
    ("prompt_lens", torch.ones(4, 1, dtype=torch.int64), "'prompt_lens' has 2 dimensions, expected 1"),
    ("completion_lens", torch.tensor(3), "'completion_lens' has 0 dimensions, expected 1"),
    ("advantages", torch.zeros(4, 1), "'advantages' has 2 dimensions"),
    ("gen_logps", torch.zeros(36), "'gen_logps' has 1 dimensions, expected 2"),
    ("rewards", torch.zeros(4, 2), "'rewards' has 2 dimensions"),
])
def test_rejects_wrong_ranks(name, value, match):
    expect(match, with_tensor(name, value))


@pytest.mark.parametrize("name,value,match", [
    ("prompt_lens", torch.tensor([3, 5, 1]), "'prompt_lens' has 3 entries for 4 rows"),
    ("completion_lens", torch.tensor([6, 1, 9, 2, 1]), "'completion_lens' has 5 entries for 4 rows"),
    ("advantages", torch.zeros(2), "'advantages' has 2 entries for 4 rows"),
    ("gen_logps", torch.zeros(4, 8), r"'gen_logps' has shape \(4, 8\), expected \(4, 9\)"),
    ("gen_logps", torch.zeros(4, 10), r"'gen_logps' has shape \(4, 10\)"),
    ("gen_logps", torch.zeros(3, 9), r"'gen_logps' has shape \(3, 9\)"),
    ("rewards", torch.zeros(5), "'rewards' must be B finite values"),
])
def test_rejects_inconsistent_shapes(name, value, match):
    expect(match, with_tensor(name, value))


def test_rejects_inconsistent_ref_logps_shape():
    expect(r"'ref_logps' has shape \(4, 3\)", with_tensor("ref_logps", torch.zeros(4, 3), kind="scored"),
           decoder=decode_scored)


@pytest.mark.parametrize("name", ["input_ids", "prompt_lens", "completion_lens", "advantages"])
def test_rejects_missing_required_tensor(name):
    expect(f"tensor '{name}' missing", with_tensor(name, None))


def test_rejects_zero_rows_and_too_many_rows():
    t = {"input_ids": torch.zeros(0, 5, dtype=torch.int64), "prompt_lens": torch.zeros(0, dtype=torch.int64),
         "completion_lens": torch.zeros(0, dtype=torch.int64), "advantages": torch.zeros(0)}
    expect("batch has 0 rows", raw(t))
    n = MAX_ROWS + 1
    t = {"input_ids": torch.zeros(n, 2, dtype=torch.int64), "prompt_lens": torch.ones(n, dtype=torch.int64),
         "completion_lens": torch.ones(n, dtype=torch.int64), "advantages": torch.zeros(n)}
    expect(f"batch has {n} rows; allowed 1..{MAX_ROWS}", raw(t))


@pytest.mark.parametrize("pl,cl,match", [
    ([3, 0, 1, 4], [6, 1, 9, 2], "every prompt length must be >= 1"),
    ([3, -2, 1, 4], [6, 1, 9, 2], "every prompt length must be >= 1"),
    ([3, 5, 1, 4], [6, 0, 9, 2], "every completion length must be >= 1"),
    ([3, 5, 1, 4], [6, 1, -9, 2], "every completion length must be >= 1"),
    ([3, 5, 1, 9], [6, 1, 9, 4], "exceeds the row length 12"),       # 13 > L = 12
    ([3, 5, 12, 4], [6, 1, 1, 2], "exceeds the row length 12"),
    ([2 ** 63 - 1, 5, 1, 4], [6, 1, 9, 2], "exceeds the row length"),  # would overflow the sum
    ([3, 5, 1, 4], [6, 1, 2 ** 63 - 1, 2], "exceeds the row length"),
])
def test_rejects_lengths_out_of_range(pl, cl, match):
    b = make_rollout(gen_logps=False)  # L = 10 + 2 = 12
    t = tensors_of(b)
    t["prompt_lens"], t["completion_lens"] = torch.tensor(pl), torch.tensor(cl)
    expect(match, raw(t))


def test_rejects_int32_length_overflow():
    t = tensors_of(make_rollout(gen_logps=False))
    t["prompt_lens"] = torch.tensor([2 ** 31 - 1, 5, 1, 4], dtype=torch.int32)
    t["completion_lens"] = torch.tensor([6, 1, 9, 2], dtype=torch.int32)
    expect("exceeds the row length", raw(t))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["advantages", "gen_logps", "rewards", "ref_logps"])
def test_rejects_non_finite_floats(name, bad):
    base = make_scored()
    t = getattr(base, name).clone()
    t.view(-1)[1] = bad
    expect(f"{name}.*(NaN or inf|finite)", with_tensor(name, t, base=base, kind="scored"), decoder=decode_scored)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_found_at_every_position(bad):
    """The range checks use one min/max reduction per tensor: a bad value anywhere must show."""
    b = make_scored(prompt_lens=(2,) * 8, completion_lens=(40, 3, 17, 40, 1, 8, 33, 21), extra_width=0)
    for name in ("gen_logps", "ref_logps", "advantages", "rewards"):
        t = getattr(b, name)
        for k in range(t.numel()):
            u = t.clone()
            u.view(-1)[k] = bad
            with pytest.raises(ProtocolError, match=f"{name}.*(NaN or inf|finite)"):
                validate_batch(ScoredBatch(**{**b.__dict__, name: u}))


@pytest.mark.parametrize("name", ["gen_logps", "ref_logps"])
def test_rejects_positive_logprobs(name):
    base = make_scored()
    t = getattr(base, name).clone()
    t[2, 3] = 0.5
    expect(f"'{name}' has positive log-probabilities", with_tensor(name, t, base=base, kind="scored"),
           decoder=decode_scored)
    t[2, 3] = 1e-7  # float noise around log(1) = 0 is fine
    decode_scored(with_tensor(name, t, base=base, kind="scored"))


def test_rejects_token_ids_out_of_vocab():
    b = make_rollout(gen_logps=False)
    data = encode_rollout(b)
    top = int(b.input_ids.max())
    decode_rollout(data, vocab_size=top + 1)
    expect(f"token id {top} >= vocab size {top}", data, vocab_size=top)
    t = tensors_of(b)
    t["input_ids"][1, 0] = -5
    expect("negative token id", raw(t))


def test_rejects_rows_longer_than_max_seq_len():
    b = make_rollout(gen_logps=False)  # L = 12, longest prompt 5
    data = encode_rollout(b)
    decode_rollout(data, max_seq_len=12)
    expect("sequence length 12 exceeds the limit 11", data, max_seq_len=11)
    expect("sequence length 12 exceeds the limit 6", data, max_seq_len=6)


def test_rejects_rows_over_the_hard_limit():
    from common.wire.protocol import MAX_SEQ_LEN
    L = MAX_SEQ_LEN + 1
    t = {"input_ids": torch.zeros(1, L, dtype=torch.int64), "prompt_lens": torch.tensor([1]),
         "completion_lens": torch.tensor([1]), "advantages": torch.zeros(1)}
    expect(f"sequence length {L} exceeds the limit {MAX_SEQ_LEN}", raw(t))


@pytest.mark.parametrize("version", ["0", "2", "999"])
def test_rejects_unknown_protocol_version(version):
    expect(f"unknown protocol version {int(version)}", raw(tensors_of(make_rollout()), protocol_version=version))


@pytest.mark.parametrize("meta,match", [
    ({"protocol_version": None}, "metadata field 'protocol_version' missing"),
    ({"protocol_version": "one"}, "metadata field 'protocol_version' is not an integer"),
    ({"policy_version": None}, "metadata field 'policy_version' missing"),
    ({"policy_version": "1.5"}, "metadata field 'policy_version' is not an integer"),
    ({"policy_version": "9" * 5000}, "metadata field 'policy_version' is not an integer"),
    ({"policy_version": "-1"}, "policy_version must be a non-negative integer"),
    ({"extra": "{not json"}, "metadata 'extra' is not JSON"),
    ({"extra": "[1, 2]"}, "metadata 'extra' must be a JSON object"),
    ({"extra": "[" * 50_000}, "metadata 'extra' is not JSON"),           # deep nesting, not RecursionError
    ({"producer_id": "x" * (MAX_META_CHARS + 1)}, "metadata field 'producer_id' too long"),
    ({"extra": json.dumps({"k": "x" * MAX_META_CHARS})}, "metadata field 'extra' too long"),
])
def test_rejects_bad_metadata(meta, match):
    expect(match, raw(tensors_of(make_rollout()), **meta))


@pytest.mark.parametrize("kind", ["scored", "Rollout", "", None, "rollout "])
def test_rollout_decoder_rejects_wrong_kind(kind):
    expect(r"expected a 'rollout' message, got", raw(tensors_of(make_rollout()), kind=kind))


def test_scored_decoder_rejects_a_rollout_and_vice_versa():
    expect("expected a 'scored' message, got 'rollout'", encode_rollout(make_rollout()), decoder=decode_scored)
    expect("expected a 'rollout' message, got 'scored'", encode_scored(make_scored()))


@pytest.mark.parametrize("name", ["ref_logps", "attention_mask", "__payload", "gen_logps_2"])
def test_rejects_unknown_tensors(name):
    t = tensors_of(make_rollout())
    t[name] = torch.zeros(4, 9)
    expect(f"unknown tensor\\(s\\) \\['{name}'\\]", raw(t))
    t = tensors_of(make_scored())
    if name != "ref_logps":
        t[name] = torch.zeros(4, 9)
        expect(f"unknown tensor\\(s\\) \\['{name}'\\]", raw(t, kind="scored"), decoder=decode_scored)


def test_rejects_truncated_bytes():
    data = encode_scored(make_scored())
    for n in (0, 1, 7):
        expect("too short", data[:n], decoder=decode_scored)
    header_end = 8 + int.from_bytes(data[:8], "little")
    for n in (8, 9, header_end // 2, header_end - 1):
        expect("header length field", data[:n], decoder=decode_scored)
    for n in (header_end, header_end + 1, len(data) - 1):
        expect("not a valid safetensors message", data[:n], decoder=decode_scored)


def test_rejects_trailing_garbage():
    data = encode_rollout(make_rollout())
    expect("not a valid safetensors message", data + b"\0" * 4)


def test_rejects_lying_header_length():
    data = encode_rollout(make_rollout())
    n = int.from_bytes(data[:8], "little")
    body = data[8:]
    expect("header is not valid JSON", (n + 1).to_bytes(8, "little") + body)  # swallows a data byte
    # one byte short: safetensors pads the header with spaces, so the JSON may still parse,
    # but then the data section no longer lines up
    expect("header is not valid JSON|not a valid safetensors message", (n - 1).to_bytes(8, "little") + body)
    expect("header is not valid JSON", (n // 2).to_bytes(8, "little") + body)
    expect(r"header length field \(18446744073709551615\) exceeds message size", b"\xff" * 8 + body)
    expect(r"header length field .* exceeds message size", (len(data)).to_bytes(8, "little") + body)
    expect("header is not valid JSON", (0).to_bytes(8, "little") + body)


def test_rejects_malformed_headers():
    header, body = split(encode_rollout(make_rollout()))
    expect("header is not a JSON object", join([1, 2, 3], body))
    expect("header is not valid JSON", join({"a": 1}, body)[:8] + b"\xff\xfe" + join({"a": 1}, body)[10:])
    deep = b"[" * 100_000 + b"]" * 100_000
    expect("header is not valid JSON", len(deep).to_bytes(8, "little") + deep)
    h = json.loads(json.dumps(header))
    h["__metadata__"] = ["not", "a", "map"]
    expect("not a valid safetensors message", join(h, body))
    h = json.loads(json.dumps(header))
    h["__metadata__"]["policy_version"] = 3  # metadata values must be strings
    expect("not a valid safetensors message", join(h, body))
    h = json.loads(json.dumps(header))
    h["input_ids"]["dtype"] = "I128"
    expect("not a valid safetensors message", join(h, body))
    h = json.loads(json.dumps(header))
    h["input_ids"]["shape"] = [4, 13]  # more elements than the byte range holds
    expect("not a valid safetensors message", join(h, body))
    h = json.loads(json.dumps(header))
    h["input_ids"]["data_offsets"][1] += 8  # overlapping tensors
    expect("not a valid safetensors message", join(h, body))


def test_rejects_huge_claimed_shape_without_allocating():
    header, body = split(encode_rollout(make_rollout()))
    header["input_ids"]["shape"] = [2 ** 31, 2 ** 31]
    expect("not a valid safetensors message", join(header, body))


@pytest.mark.parametrize("payload", [
    {"input_ids": [[1, 2, 3]], "kind": "rollout"},
    [torch.zeros(3)],
    "rollout",
])
def test_rejects_pickle_payload(payload):
    data = pickle.dumps(payload)
    for decoder in (decode_rollout, decode_scored):
        with pytest.raises(ProtocolError, match="header length field|too short|not valid JSON"):
            decoder(data)


def test_rejects_torch_save_payload():
    import io
    buf = io.BytesIO()
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, buf)
    expect("header length field", buf.getvalue())


@pytest.mark.parametrize("seed", range(5))
def test_rejects_random_bytes(seed):
    rng = random.Random(seed)
    for n in (0, 3, 8, 64, 1000, 20000):
        data = bytes(rng.getrandbits(8) for _ in range(n))
        with pytest.raises(ProtocolError):
            decode_rollout(data)
    # random bytes behind a plausible header length
    junk = bytes(rng.getrandbits(8) for _ in range(500))
    expect("header is not valid JSON", (200).to_bytes(8, "little") + junk)


@pytest.mark.parametrize("not_bytes", [None, "a string", 12345, [b"\0" * 8]])
def test_rejects_non_bytes(not_bytes):
    expect("too short", not_bytes)


def test_accepts_bytearray_and_memoryview():
    b = make_rollout()
    data = encode_rollout(b)
    assert_same(b, decode_rollout(bytearray(data)))
    assert_same(b, decode_rollout(memoryview(data)))


def test_encode_validates_too():
    b = make_rollout()
    b.completion_lens = b.completion_lens.clone()
    b.completion_lens[0] = 0
    with pytest.raises(ProtocolError, match="every completion length must be >= 1"):
        encode_rollout(b)
    s = make_scored()
    s.ref_logps = s.ref_logps[:, :-1]
    with pytest.raises(ProtocolError, match="'ref_logps' has shape"):
        encode_scored(s)


# --- fuzz -----------------------------------------------------------------------------
def _mutate(data: bytes, rng: random.Random) -> bytes:
    try:
        header, body = split(data)
        assert isinstance(header, dict) and len(header) > 1
        op = rng.randrange(12)
    except Exception:  # an earlier mutation broke the header: byte-level mutations only
        header, body = {}, data[8:]
        op = rng.choice([0, 2, 3, 4])
    hlen = len(data) - len(body)
    b = bytearray(data)
    if op == 0:    # flip bytes anywhere
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        return bytes(b)
    if op == 1:    # flip bytes inside the header JSON
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(8, hlen)] = rng.getrandbits(8)
        return bytes(b)
    if op == 2:    # flip bytes inside the tensor data (values: NaN, huge ids, negative lengths...)
        for _ in range(rng.randint(1, 16)):
            b[rng.randrange(min(hlen, len(b) - 1), len(b))] = rng.getrandbits(8)
        return bytes(b)
    if op == 3:    # truncate
        return bytes(b[:rng.randrange(len(b))])
    if op == 4:    # insert or delete bytes
        i = rng.randrange(len(b))
        if rng.random() < 0.5:
            return bytes(b[:i] + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 9))) + b[i:])
        return bytes(b[:i] + b[i + rng.randint(1, 9):])
    if op == 5:    # lie about the header length
        n = int.from_bytes(data[:8], "little") + rng.choice([-9, -1, 1, 2, 100, 2 ** 40, -hlen + 8])
        return (n % 2 ** 64).to_bytes(8, "little") + bytes(b[8:])
    try:
        return _mutate_header(header, body, op, rng)
    except Exception:  # the header was already too broken for this mutation: flip a byte instead
        b[rng.randrange(len(b))] = rng.getrandbits(8)
        return bytes(b)


def _mutate_header(header: dict, body: bytes, op: int, rng: random.Random) -> bytes:
    names = [k for k in header if k != "__metadata__"]
    h = json.loads(json.dumps(header))
    name = rng.choice(names)
    if op == 6:    # dtype
        h[name]["dtype"] = rng.choice(["F16", "BF16", "F64", "I32", "I16", "I8", "U8", "BOOL", "U64", "F8_E4M3",
                                       "X", 7, None])
    elif op == 7:  # shape
        h[name]["shape"] = rng.choice([[], [0], [1], [2 ** 62], [-1, 3], ["a"], None, [4, 3, 1],
                                       list(reversed(h[name]["shape"])), h[name]["shape"] + [1]])
    elif op == 8:  # offsets
        lo, hi = h[name]["data_offsets"]
        h[name]["data_offsets"] = rng.choice([[hi, lo], [lo, hi + 4], [lo - 4, hi], [0, 0], [lo], [-1, hi],
                                              [lo, 2 ** 63], "x"])
    elif op == 9:  # metadata values
        key = rng.choice(["kind", "protocol_version", "policy_version", "producer_id", "batch_id", "extra",
                          "surprise"])
        h.setdefault("__metadata__", {})[key] = rng.choice(["", "rollout", "scored", "1", "0", "-3", "1e3", " 1",
                                                            "null", "[]", "{", '{"a":', "\x00", "x" * 70000, 1,
                                                            None, [], {}])
    elif op == 10:  # drop or rename an entry
        entry = h.pop(name if rng.random() < 0.7 else "__metadata__")
        if rng.random() < 0.5:
            h[rng.choice(["ref_logps", "junk", name + "_", "__metadata__"])] = entry
    else:          # swap two tensors' descriptions
        other = rng.choice(names)
        h[name], h[other] = h[other], h[name]
    return join(h, body)


def test_fuzz_only_protocol_error_escapes():
    rng = random.Random(1234)
    seeds = [encode_rollout(make_rollout(extra=EXTRA)), encode_rollout(make_rollout(gen_logps=False, seed=3)),
             encode_scored(make_scored(prompt_lens=(1, 2), completion_lens=(5, 1))),
             encode_scored(make_scored(ref=False, rewards=False))]
    outcomes = {"accepted": 0, "rejected": 0}
    for i in range(600):
        data = rng.choice(seeds)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            data = _mutate(data, rng) if len(data) > 16 else data
        for decoder, kw in ((decode_rollout, {"vocab_size": VOCAB, "max_seq_len": 64}), (decode_scored, {})):
            try:
                b = decoder(data, **kw)
            except ProtocolError as e:
                assert str(e), "a ProtocolError must say what is wrong"
                outcomes["rejected"] += 1
            except Exception as e:  # noqa: BLE001 - this is what the test is about
                pytest.fail(f"mutation {i}: {type(e).__name__} escaped {decoder.__name__}: {e}")
            else:
                outcomes["accepted"] += 1
                validate_batch(b)  # whatever got through is a consistent batch
    assert outcomes["rejected"] > 500, outcomes


# --- docs/protocol.md examples really work ----------------------------------------------------
def _doc_blocks() -> list[str]:
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_doc_hand_written_encoder_produces_a_valid_message():
    block = next(b for b in _doc_blocks() if "def encode(tensors, metadata)" in b)
    ns: dict = {}
    exec(block, ns)  # noqa: S102 - our own documentation
    b = decode_rollout(ns["msg"], vocab_size=100, max_seq_len=6)
    assert b.input_ids.tolist() == [[11, 12, 13, 21, 22, 23]] and b.producer_id == "hand-written"
    assert b.batch_id == "0001" and b.advantages.tolist() == [0.5] and b.gen_logps is None
    # the alignment padding is optional: without it the message still decodes
    lines = [ln for ln in block.splitlines() if "align the data section" not in ln]
    assert len(lines) == len(block.splitlines()) - 1
    ns2: dict = {}
    exec("\n".join(lines), ns2)  # noqa: S102
    assert len(ns2["msg"]) != len(ns["msg"]) or (int.from_bytes(ns["msg"][:8], "little") % 8 == 0)
    assert decode_rollout(ns2["msg"]).input_ids.tolist() == b.input_ids.tolist()


def test_doc_client_example_runs_against_a_fake_server(monkeypatch, capsys):
    import types
    block = next(b for b in _doc_blocks() if "requests.post" in b)
    queue: list[bytes] = []
    calls = {"post": 0}

    def post(url, data, headers, timeout):
        assert url.endswith("/upload") and headers["Content-Type"] == CONTENT_TYPE
        calls["post"] += 1
        if calls["post"] == 1:  # first attempt: backpressure
            return types.SimpleNamespace(status_code=503, headers={"Retry-After": "0"}, json=lambda: {})
        rb = decode_rollout(data)
        ref = torch.where(rb.completion_mask(), torch.full(rb.gen_logps.shape, -1.0), torch.zeros(()))
        queue.append(encode_scored(ScoredBatch.from_rollout(rb, ref)))
        return types.SimpleNamespace(status_code=202, headers={},
                                     json=lambda: {"id": rb.batch_id, "queued": len(queue)})

    def get(url, params, headers, timeout):
        assert url.endswith("/get") and timeout > params["wait"]
        return types.SimpleNamespace(status_code=200, content=queue.pop(0), headers={})

    import requests
    monkeypatch.setattr(requests, "post", post)
    monkeypatch.setattr(requests, "get", get)
    monkeypatch.setenv("GRPO_REF_TOKEN", "t0k")
    exec(block, {})  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "queued" in out and "torch.Size([2, 3])" in out and calls["post"] == 2
