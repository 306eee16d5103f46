"""Bounded packs (common/packing.py pack_plan, the pack_tokens knob): padding_free no longer packs a whole
micro-batch into one sequence, whose dense N x N sdpa mask made a step of 32 rows x ~640 tokens take 87 s on CPU.
Rows go into packs of at most pack_tokens tokens, one forward each; the logprobs, entropies and the update are
those of one pack: per forward here, and as the float64 gradient at ZeRO stages 0, 2 and 3 with grad_accum 2 and
tool turns (loss_mask) through tests/test_microbatch.py's engines. Two ZeRO-3 ranks that need different pack
counts: tests/test_zero3_lockstep.py and the slow case at the end of this file."""
from __future__ import annotations

import pytest
import torch
from test_microbatch import (
    check_update,
    config,
    dist,  # noqa: F401  (fixture: one gloo rank for this module's engines)
    make_batch,
    reference_grads,
    sgd_engine,
    tiny_float32,
    with_tool_turns,
)
from test_packing import rows, tiny  # noqa: F401  (fixture)

from common.config import GRPOConfig
from common.logprobs import forward_calls, sequence_logprobs
from common.packing import pack_plan
from trainer.objective.update import new_round, train_update

PACK = 12  # tokens: test_microbatch's 3-row micro-batches (rows of 3 to 15 tokens) split into 2 or 3 packs


def test_pack_plan_bounds_each_pack():
    pl, cl = torch.tensor([3, 9, 1, 5, 2]), torch.tensor([6, 2, 11, 1, 8])  # 9, 11, 12, 6, 10 tokens
    assert [g.tolist() for g in pack_plan(pl, cl, 20)] == [[0, 1], [2, 3], [4]]
    assert [g.tolist() for g in pack_plan(pl, cl, 5)] == [[0], [1], [2], [3], [4]]  # a longer row alone
    assert [g.tolist() for g in pack_plan(pl, cl, None)] == [[0, 1, 2, 3, 4]]  # unbounded: one pack
    # (packs, head calls of the pack with the most completion positions: 11 + 1 in chunks of 4 -> 3)
    assert forward_calls(pl, cl, 4, True, 20) == (3, 3) and forward_calls(pl, cl, 4, True, None) == (1, 7)
    assert forward_calls(pl, cl, 5, False, 20) == (1, 11)  # padded: one forward, pack_tokens does not apply


def test_bounded_packs_equal_one_pack_with_their_calls(tiny):  # noqa: F811
    """Forward and gradient of 3 packs equal one pack's; each pack is one body forward; min_packs adds dummy
    forwards (ZeRO-3 ranks with fewer packs) that change no number, and min_chunks counts head calls per pack."""
    model = tiny
    ids, pl, cl = rows(model.config.vocab_size)
    body, head = getattr(model, model.base_model_prefix), model.get_output_embeddings()
    calls = {"body": 0, "head": 0}
    hooks = [body.register_forward_hook(lambda *_: calls.__setitem__("body", calls["body"] + 1)),
             head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))]

    def run(**kw):
        model.zero_grad()
        for k in calls:
            calls[k] = 0
        lp, ent = sequence_logprobs(model, ids, pl, cl, chunk_tokens=4, with_entropy=True, padding_free=True, **kw)
        forward = dict(calls)  # before backward's recompute of the checkpointed head chunks
        (lp * torch.linspace(0.5, 2, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}, forward

    try:
        model.requires_grad_(True)
        one, one_ent, one_grad, _ = run()
        lp, ent, grad, n = run(pack_tokens=20)
        assert n == {"body": 3, "head": 2 + 3 + 2}  # chunks of 4 positions, the entropy from the same logits
        extra, extra_ent, extra_grad, m = run(pack_tokens=20, min_packs=5, min_chunks=6)
    finally:
        model.requires_grad_(False)
        for h in hooks:
            h.remove()
    assert m == {"body": 5, "head": 5 * 6}
    torch.testing.assert_close(lp, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, one_ent, rtol=1e-5, atol=1e-5)
    assert torch.equal(extra, lp) and torch.equal(extra_ent, ent)
    for k in one_grad:
        tol = 1e-5 * float(one_grad[k].abs().max())  # float32 sums in another order: relative to the largest
        torch.testing.assert_close(grad[k], one_grad[k], rtol=1e-4, atol=tol, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(extra_grad[k], grad[k], rtol=1e-6, atol=1e-8, msg=lambda m, k=k: f"{k}: {m}")


def test_pack_tokens_knob():
    assert GRPOConfig().pack_tokens == 4096
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="pack_tokens"):
            GRPOConfig(pack_tokens=bad).validate()


def micro_packs(batches, cfg) -> list[int]:
    """Packs of each 3-row micro-batch (row order: padding_free keeps it)."""
    return [len(pack_plan(b.prompt_lens[s:s + 3], b.completion_lens[s:s + 3], cfg.pack_tokens))
            for b in batches for s in range(0, 8, 3)]


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("aggregation,tools", [("seq_mean", False), ("dapo", True)])
def test_bounded_packs_make_the_float64_update(dist, stage, aggregation, tools):  # noqa: F811
    """grad_accum 2 x three micro-batches, each split into 2 or 3 packs of at most 12 tokens: the update is the
    float64 gradient (with tool turns: of the sampled tokens only)."""
    cfg = config(aggregation, "token", grad_accum=2)
    cfg.pack_tokens = PACK
    eng = sgd_engine(dist, stage, grad_accum=2, gradient_checkpointing=True)
    batches = [make_batch(eng.module.config.vocab_size, seed) for seed in (1, 2)]
    if tools:
        batches = [with_tool_turns(b) for b in batches]
    assert min(micro_packs(batches, cfg)) >= 2  # every micro-batch really splits
    stats = check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))
    assert stats["padding_free"] == 1.0 and stats["padding_share"] == 0.0


@pytest.fixture(scope="module")
def two_rank_updates(rank_probes) -> dict:
    """Real `deepspeed --num_gpus 2` ranks (tests/zero3_update_probe.py in the suite's one launch of 2-rank probes,
    tests/rank_probes.py) for both slow cases below: stage 0, stage 3, and stage 3 with packs of at most PACK tokens,
    each a fresh engine from the same weights: {entry: weights}."""
    log = rank_probes.out
    assert rank_probes.returncode == 0 and "rank1 PROBES DONE" in log, log[-4000:]
    for entry in ("0", "3", f"3@{PACK}"):
        assert f"rank0 stage {entry} updated" in log and f"rank1 stage {entry} updated" in log, log[-4000:]
    return torch.load(rank_probes.folder / "updates.pt")


@pytest.mark.slow
def test_two_zero3_ranks_make_the_zero0_update(two_rank_updates):
    """Real `deepspeed --num_gpus 2` (gloo) ranks at stages 0 and 3 on the same batches: the ZeRO-3 update
    (partitioned weights and gradients, reduce-scatter) equals the ZeRO-0 one."""
    runs = {k: two_rank_updates[k] for k in ("0", "3")}
    assert runs["0"]["global_steps"] == runs["3"]["global_steps"] == 1
    assert runs["0"]["zero_stage"] == 0 and runs["3"]["zero_stage"] == 3
    for n, w0 in runs["0"]["before"].items():
        assert torch.equal(w0, runs["3"]["before"][n]), n  # the same start
        want, got = w0 - runs["0"]["after"][n], runs["3"]["before"][n] - runs["3"]["after"][n]
        assert float(want.abs().max()) > 0, n
        ulp = torch.finfo(torch.float32).eps * float(w0.abs().max())  # the float32 weights' own rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 2 * ulp,
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
def test_two_zero3_ranks_with_different_pack_counts_make_the_float64_update(two_rank_updates):
    """`deepspeed --num_gpus 2` at stage 3 (tests/zero3_update_probe.py), dapo over both ranks, packs of at most
    PACK tokens, rank 0's micro-batches needing other pack counts than rank 1's: the update equals the float64
    gradient of the loss over all four batches (DeepSpeed averages the ranks' gradients; dapo's normaliser
    counts both ranks' tokens)."""
    run = two_rank_updates[f"3@{PACK}"]
    assert run["global_steps"] == 1 and run["zero_stage"] == 3
    cfg = config("dapo", "token", grad_accum=2)
    cfg.pack_tokens = PACK
    model = tiny_float32()  # cfg.model is the tiny model
    vocab = model.config.vocab_size
    ranks = [[make_batch(vocab, seed) for seed in (2 * r + 1, 2 * r + 2)] for r in (0, 1)]
    assert micro_packs(ranks[0], cfg) != micro_packs(ranks[1], cfg)  # rank 1 makes dummy forwards somewhere
    model.load_state_dict({n: w.float() for n, w in run["before"].items()}, strict=False)
    want = reference_grads(model, ranks[0] + ranks[1], cfg)
    for n, g in want.items():
        got = run["before"][n] - run["after"][n]  # SGD at lr 1
        torch.testing.assert_close(got, g, rtol=2e-4, atol=1e-5 * float(g.abs().max()) + 1e-7,
                                   msg=lambda m, n=n: f"{n}: {m}")
