"""common.wire.protocol: exact round trips and the docs/protocol.md examples; rejections of malformed tensors:
tests/test_protocol_limits.py, of malformed messages (and a fuzz): tests/test_protocol_messages.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save as st_save

from common.wire.protocol import (
    CONTENT_TYPE,
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
    assert CONTENT_TYPE == "application/vnd.grpo.safetensors" and PROTOCOL_VERSION == 2
    header, _ = split(encode_rollout(make_rollout()))
    assert header["__metadata__"]["kind"] == "rollout"
    assert header["__metadata__"]["protocol_version"] == "1"  # no loss_mask: version-1 readers still read it
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


# --- rejection helpers (tests/test_protocol_limits.py, tests/test_protocol_messages.py) ---------
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
