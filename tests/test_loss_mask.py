"""Issue 32, "only the model's tokens train": the per-token loss mask on the wire (common/wire/protocol.py, protocol
version 2), through the real ref server, and in the loss (trainer/objective/): a tool turn's tokens are in the
sequence but in no loss term, no normaliser and no per-token metric.

The loss is checked against a float64 re-derivation that only ever sees the kept tokens (gathered row by row), for
every objective, aggregation and importance-sampling level; the update (DeepSpeed, micro-batches, IS correction,
off-policy and entropy masks) against the same update on a batch that differs only at the masked positions.
The ZeRO 0/2/3 x grad_accum 2 x packing cases are in tests/test_microbatch.py (test_loss_mask_keeps_...), whose
engines and float64 reference this module reuses."""
from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save as st_save
from test_microbatch import (  # noqa: F401  (dist: fixture)
    ROWS,
    config,
    dist,
    full_weights,
    make_batch,
    sgd_engine,
    tiny_float32,
    with_tool_turns,
)

from common.wire.client import RefClient
from common.wire.protocol import (
    ProtocolError,
    RolloutBatch,
    ScoredBatch,
    collate,
    decode_rollout,
    decode_scored,
    encode_rollout,
    encode_scored,
)
from trainer.objective.grpo import grpo_loss
from trainer.objective.update import new_round, train_update

CLENS = [6, 4, 5, 2]
KEEP = torch.tensor([[1, 1, 0, 0, 1, 1],   # a tool turn in the middle
                     [1, 0, 0, 1, 0, 0],
                     [1, 1, 1, 0, 0, 0],   # ends in a tool turn (budget spent)
                     [1, 1, 0, 0, 0, 0]], dtype=torch.bool)  # no tool call: all its tokens train


def rollout(loss_mask: torch.Tensor | None = KEEP, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    cl = torch.tensor(CLENS)
    pl = torch.tensor([3, 2, 4, 1])
    ids = torch.zeros(4, int((pl + cl).max()) + 1, dtype=torch.long)
    for i, n in enumerate((pl + cl).tolist()):
        ids[i, :n] = torch.randint(3, 500, (n,), generator=g)
    inside = torch.arange(6)[None] < cl[:, None]
    return RolloutBatch(input_ids=ids, prompt_lens=pl, completion_lens=cl, advantages=torch.randn(4, generator=g),
                        gen_logps=-torch.rand(4, 6, generator=g) * inside, rewards=torch.rand(4, generator=g),
                        batch_id=f"lm{seed}", loss_mask=loss_mask)


def header(data: bytes) -> dict:
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])


# --- the wire ---------------------------------------------------------------------------
def test_round_trip_writes_version_2_and_a_bool_tensor():
    b = rollout()
    data = encode_rollout(b)
    h = header(data)
    assert h["__metadata__"]["protocol_version"] == "2" and h["loss_mask"]["dtype"] == "BOOL"
    got = decode_rollout(data)
    assert got.loss_mask.dtype == torch.bool and torch.equal(got.loss_mask, KEEP)
    s = decode_scored(encode_scored(ScoredBatch.from_rollout(got, -torch.rand(4, 6) * got.completion_mask())))
    assert torch.equal(s.loss_mask, KEEP)
    # without a mask: version 1, no tensor, decoded as None (all ones)
    plain = encode_rollout(rollout(None))
    assert header(plain)["__metadata__"]["protocol_version"] == "1" and "loss_mask" not in header(plain)
    assert decode_rollout(plain).loss_mask is None


def test_version_1_blob_without_mask_decodes_to_none_and_u8_masks_are_read():
    """A protocol-1 producer's message (written by safetensors itself) still decodes: no mask = all ones. A
    producer without bool tensors may send the mask as U8 0/1."""
    b = rollout(None)
    t = {k: getattr(b, k) for k in ("input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps")}
    meta = {"kind": "rollout", "protocol_version": "1", "policy_version": "0", "producer_id": "v1",
            "batch_id": "old", "extra": "{}"}
    old = decode_rollout(st_save(t, metadata=meta))
    assert old.loss_mask is None and torch.equal(old.input_ids, b.input_ids)
    got = decode_rollout(st_save({**t, "loss_mask": KEEP.to(torch.uint8)}, metadata={**meta, "protocol_version": "2"}))
    assert got.loss_mask.dtype == torch.bool and torch.equal(got.loss_mask, KEEP)


def _bad_masks() -> list:
    past = KEEP.clone()
    past[3, 4] = True  # row 3 has 2 tokens
    empty = KEEP.clone()
    empty[1] = False
    return [(KEEP[:, :5], "'loss_mask' has shape"), (KEEP[:3], "'loss_mask' has shape"),
            (past, "ones past a row's completion_lens"), (empty, "row 1 has no 1"),
            (KEEP.float(), "'loss_mask' has dtype"), (KEEP[0], "'loss_mask' has 1 dimensions")]


@pytest.mark.parametrize("mask,match", _bad_masks())
def test_bad_masks_are_refused_by_encoder_and_decoder(mask, match):
    with pytest.raises(ProtocolError, match=match):
        encode_rollout(rollout(mask))
    b = rollout(None)
    t = {k: getattr(b, k) for k in ("input_ids", "prompt_lens", "completion_lens", "advantages")}
    meta = {"kind": "rollout", "protocol_version": "2", "policy_version": "0", "batch_id": "x", "extra": "{}"}
    with pytest.raises(ProtocolError, match=match):
        decode_rollout(st_save({**t, "loss_mask": mask.contiguous()}, metadata=meta))


def test_mask_needs_version_2_and_bytes_must_be_0_or_1():
    b = rollout(None)
    t = {k: getattr(b, k) for k in ("input_ids", "prompt_lens", "completion_lens", "advantages")}
    meta = {"kind": "rollout", "protocol_version": "1", "policy_version": "0", "batch_id": "x", "extra": "{}"}
    with pytest.raises(ProtocolError, match="'loss_mask' needs protocol_version 2, the message says 1"):
        decode_rollout(st_save({**t, "loss_mask": KEEP}, metadata=meta))
    two = KEEP.to(torch.uint8)
    two[0, 0] = 2
    with pytest.raises(ProtocolError, match="values other than 0 and 1"):
        decode_rollout(st_save({**t, "loss_mask": two}, metadata={**meta, "protocol_version": "2"}))


def test_collate_keeps_the_mask_row_aligned():
    """Batches with and without a mask concatenate: the mask-less rows get all ones over their completions."""
    a, b = rollout(seed=1), rollout(None, seed=2)
    b.completion_lens = torch.tensor([2, 7, 1, 3])
    b.input_ids = torch.nn.functional.pad(b.input_ids, (0, 3))
    b.gen_logps = None
    c = collate([a, b])
    assert c.loss_mask.shape == (8, 7)
    assert torch.equal(c.loss_mask[:4, :6], KEEP) and not c.loss_mask[:4, 6].any()
    assert torch.equal(c.loss_mask[4:], b.completion_mask())
    assert collate([rollout(None), rollout(None)]).loss_mask is None


# --- the loss, against float64 on the kept tokens only --------------------------------
def reference_loss(logps, ref, old, adv, keep, *, beta, eps_low, eps_high, aggregation, max_new_tokens, level,
                   is_w, objective, tau):
    """The loss computed row by row from the kept tokens alone (gathered: a masked token is never read)."""
    terms = []
    for i in range(logps.shape[0]):
        k = keep[i].nonzero().flatten()
        lp = logps[i, k]
        d = lp - (lp.detach() if old is None else old[i, k])
        r = torch.exp(d.mean()).expand(len(k)) if level == "sequence" else torch.exp(d)
        A = adv[i]
        if objective == "cispo":
            t = -torch.clamp(r, max=eps_high).detach() * A * lp
        elif objective == "sapo":
            tt = tau[0] if A > 0 else tau[1]
            t = -torch.sigmoid(tt * (r - 1)) * 4 / tt * A
        elif old is not None:
            t = -torch.min(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)
        else:
            t = -r * A
        t = t * is_w[i, k]
        dr = ref[i, k] - lp
        terms.append(t + beta * (torch.exp(dr) - dr - 1))
    if aggregation == "seq_mean":
        return torch.stack([t.mean() for t in terms]).mean()
    if aggregation == "token_mean":
        return torch.cat(terms).sum() / sum(len(t) for t in terms)
    if aggregation == "luspo":
        return torch.stack([t.sum() for t in terms]).mean()
    return torch.cat(terms).sum() / (len(terms) * max_new_tokens)


def loss_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    inside = torch.arange(6)[None] < torch.tensor(CLENS)[:, None]
    logps = (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 3) * inside
    return dict(logps=logps, ref=logps - torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5,
                old=logps + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3,  # ratios in and out of the band
                adv=torch.tensor([1.0, -0.7, 0.4, -1.2], dtype=torch.float64),
                is_w=torch.rand(4, 6, generator=g, dtype=torch.float64) + 0.5, inside=inside)


def run_loss(x: dict, objective: str, aggregation: str, level: str, loss_mask):
    logps = x["logps"].clone().requires_grad_(True)
    old = None if objective == "reinforce" else x["old"]
    eps = (3e-2, 4e-2) if level == "sequence" else (0.2, 0.28)
    loss = grpo_loss(logps, x["ref"], old, x["adv"], x["inside"], beta=0.04, eps_low=eps[0],
                     eps_high=5.0 if objective == "cispo" else eps[1], aggregation=aggregation, max_new_tokens=8,
                     importance_sampling_level=level, is_weights=x["is_w"],
                     objective="clip" if objective == "reinforce" else objective, sapo_tau=(1.0, 1.05),
                     loss_mask=loss_mask)
    loss.backward()
    return loss.detach(), logps.grad


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "dr_grpo", "luspo"])
@pytest.mark.parametrize("objective", ["clip", "cispo", "sapo", "reinforce"])
def test_every_loss_against_float64_on_the_kept_tokens(objective, aggregation, level):
    x = loss_inputs()
    loss, grad = run_loss(x, objective, aggregation, level, KEEP)
    lp = x["logps"].clone().requires_grad_(True)
    eps = (3e-2, 4e-2) if level == "sequence" else (0.2, 0.28)
    want = reference_loss(lp, x["ref"], None if objective == "reinforce" else x["old"], x["adv"], KEEP, beta=0.04,
                          eps_low=eps[0], eps_high=5.0 if objective == "cispo" else eps[1], aggregation=aggregation,
                          max_new_tokens=8, level=level, is_w=x["is_w"], objective=objective, tau=(1.0, 1.05))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-12, atol=1e-12)
    assert (grad[~KEEP] == 0).all()  # no gradient reaches a tool token
    # whatever the logprobs (policy, reference, pi_old, IS weights) say at the masked positions: nothing changes
    y = {k: v.clone() for k, v in x.items()}
    tool = ~KEEP & x["inside"]
    for k, shift in (("logps", -1.5), ("ref", -4.0), ("old", 2.0), ("is_w", 7.0)):
        y[k][tool] += shift
    loss2, grad2 = run_loss(y, objective, aggregation, level, KEEP)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad2, grad, rtol=1e-12, atol=1e-12)
    # and the masked loss is not the unmasked one (the mask does something in every case)
    assert not torch.allclose(run_loss(x, objective, aggregation, level, None)[1], grad)


def test_an_all_ones_mask_is_no_mask():
    x = loss_inputs(1)
    for agg in ("seq_mean", "dr_grpo"):
        a = run_loss(x, "clip", agg, "sequence", None)
        b = run_loss(x, "clip", agg, "sequence", x["inside"].clone())
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- the update: IS correction, off-policy and entropy masks, metrics ------------------
def entropy_over(model, b: ScoredBatch, keep: torch.Tensor) -> float:
    """Mean next-token entropy (float64, full logits) over the kept completion tokens."""
    m = model.double()
    L = b.input_ids.shape[1]
    att = (torch.arange(L)[None] < (b.prompt_lens + b.completion_lens)[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=b.input_ids, attention_mask=att).logits.double(), -1)
    ent = -(logp.exp() * logp).sum(-1)
    T = keep.shape[1]
    pos = (b.prompt_lens[:, None] + torch.arange(T)[None]).clamp(max=L - 1) - 1
    return float(ent.gather(1, pos)[keep].mean())


@pytest.mark.parametrize("is_mode", ["token_mask", "sequence_truncate"])
def test_update_ignores_everything_at_masked_positions(dist, is_mode):  # noqa: F811
    """Two engines from the same weights, one update each on batches that differ only in the engine's and the
    reference's logprobs at the tool tokens: with the IS correction (token / sequence), the off-policy sequence
    mask and the entropy mask on, the weights move identically and every per-token metric agrees; the entropy
    metric is the float64 mean over the kept tokens. Without the mask the same change moves the update."""
    cfg = config("token_mean", "token", is_mode)
    cfg.vllm_importance_sampling_clip_max, cfg.off_policy_mask_threshold, cfg.top_entropy_quantile = 3.0, 0.5, 0.6
    cfg.validate()
    vocab = 548
    b1 = with_tool_turns(make_batch(vocab, 3))
    b2 = with_tool_turns(make_batch(vocab, 3))
    tool = b1.completion_mask() & ~b1.loss_mask
    g = torch.Generator().manual_seed(5)
    b2.gen_logps = b2.gen_logps - tool * (torch.rand(b2.gen_logps.shape, generator=g) * 8 + 1)
    b2.ref_logps = b2.ref_logps - tool * (torch.rand(b2.ref_logps.shape, generator=g) * 8 + 1)
    runs = []
    for b in (b1, b2, ScoredBatch.from_rollout(
            RolloutBatch(**{k: getattr(b2, k) for k in RolloutBatch.__dataclass_fields__ if k != "loss_mask"}),
            b2.ref_logps)):
        eng = sgd_engine(dist, 0)
        before = full_weights(dist, eng)
        want_entropy = entropy_over(tiny_float32().eval(), b,
                                    b.completion_mask() if b.loss_mask is None else b.loss_mask)
        stats = train_update(eng, new_round([b], cfg, "cpu"), cfg)
        after = full_weights(dist, eng)
        assert stats["entropy"] == pytest.approx(want_entropy, rel=1e-4)
        runs.append(({n: before[n] - after[n] for n in before}, stats))
    (d1, s1), (d2, s2), (d3, s3) = runs
    for n in d1:
        torch.testing.assert_close(d2[n], d1[n], rtol=1e-5, atol=1e-7 * (1 + float(d1[n].abs().max())))
    for k in ("kl", "clip_frac", "ratio_mean", "entropy", "logp_mismatch_mean", "logp_mismatch_max", "is_weight_mean",
              "is_masked_share", "off_policy_masked_share", "entropy_kept_share", "loss"):
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-7), k
    assert s3["kl"] != pytest.approx(s1["kl"]) and s3["logp_mismatch_mean"] != pytest.approx(s1["logp_mismatch_mean"])
    assert any(not torch.allclose(d3[n], d1[n], rtol=1e-3, atol=1e-6) for n in d1)


# --- the real ref server --------------------------------------------------------------
def test_mask_through_the_ref_server(start_server, tiny_model_dir):
    """/upload a masked batch and an unmasked one, /get them back scored: the mask comes back row-aligned and
    unchanged (the server may merge both into one forward), the reference scored every token, tool tokens too."""
    masked, plain = rollout(seed=11), rollout(None, seed=12)
    with start_server(tiny_model_dir, "--dtype", "float32", "--device", "cpu") as srv, \
            RefClient(srv.url, timeout=30, max_retries=3, backoff=0.1) as client:
        client.wait_ready(timeout=30)
        for b in (masked, plain):
            assert client.upload(b) == b.batch_id
        got, deadline = {}, time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            s = client.get(timeout=5)
            if s is not None:
                got[s.batch_id] = s
    assert set(got) == {masked.batch_id, plain.batch_id}
    s = got[masked.batch_id]
    assert torch.equal(s.loss_mask, KEEP) and torch.equal(s.input_ids, masked.input_ids)
    assert (s.ref_logps[s.completion_mask()] < 0).all()  # every completion token scored, the tool turns' too
    assert got[plain.batch_id].loss_mask is None
