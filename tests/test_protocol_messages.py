"""common.wire.protocol, the message: decode refuses a wrong version, kind, metadata, unknown tensors, truncated,
lying or malformed headers, pickle and torch.save payloads and random bytes with ProtocolError, and a fuzz of
mutated messages lets nothing else escape. Builders: tests/test_protocol.py."""
from __future__ import annotations

import json
import pickle
import random

import pytest
import torch
from test_protocol import (
    EXTRA,
    VOCAB,
    assert_same,
    expect,
    join,
    make_rollout,
    make_scored,
    raw,
    split,
    tensors_of,
)

from common.wire.protocol import (
    MAX_META_CHARS,
    ProtocolError,
    decode_rollout,
    decode_scored,
    encode_rollout,
    encode_scored,
    validate_batch,
)


@pytest.mark.parametrize("version", ["0", "3", "999"])
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
