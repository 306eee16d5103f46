"""Micro-batches (trainer/objective/microbatch.py): the update DeepSpeed makes from a step's accumulated
micro-batches equals the whole batch's gradient step, for every aggregation and for GSPO, at ZeRO stages 0, 2 and 3,
with grad_accum 1 and 2, checked against a float64 re-derivation (a plain full-logits forward of a float64 copy of
the model, no chunking, no DeepSpeed).

The engines step plain SGD (lr 1, no clipping), so the update IS minus the gradient DeepSpeed accumulated: one
readout that works at every stage (under ZeRO-2/3 the gradient lives in partitions and buckets, not in p.grad).
Before the fix (issue 30), stage 3 built the update from the last micro-batch alone: the trainer calls the model's
body and head itself, never engine(...), and ZeRO-3 advances the micro-step counter that makes it add rather than
copy gradients only in DeepSpeedEngine.forward.

Both forwards are checked (issue 33): padding_free true (each micro-batch one packed sequence, common/packing.py)
for every aggregation and GSPO at every stage, and padding_free false (rows grouped by length into micro-batches)
with grad_accum 2."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import find_free_port

from common.config import GRPOConfig
from common.modeling import load_model, resolve_model_path
from common.wire.protocol import ScoredBatch
from trainer.deepspeed_policy import ds_config_for, initialize, prepare_policy, skip_shm_op
from trainer.objective import microbatch
from trainer.objective.grpo import entropy_mask, grpo_loss
from trainer.objective.offpolicy import importance_weights
from trainer.objective.update import metric_keys, new_round, train_step, train_update

ROWS = 8
LR = 1.0


def make_batch(vocab: int, seed: int = 0, groups: int = 0) -> ScoredBatch:
    """groups > 0: that many groups of rows sharing their first row's prompt, as GRPO's groups do."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.tensor([3, 5, 4, 6, 3, 2, 5, 4]).roll(seed)
    clen = torch.tensor([7, 2, 9, 4, 1, 6, 3, 8]).roll(2 * seed)  # ragged: micro-batches have their own widths
    if groups:
        plen = plen[torch.arange(ROWS) // (ROWS // groups) * (ROWS // groups)]
    ids = torch.zeros(ROWS, int((plen + clen).max()), dtype=torch.long)
    for i in range(ROWS):
        ids[i, :plen[i] + clen[i]] = torch.randint(3, vocab, (int(plen[i] + clen[i]),), generator=g)
        if groups and i % (ROWS // groups):
            ids[i, :plen[i]] = ids[i - 1, :plen[i]]
    T = int(clen.max())
    return ScoredBatch(ids, plen, clen, torch.randn(ROWS, generator=g),
                       gen_logps=-torch.rand(ROWS, T, generator=g) * 2 - 6,
                       ref_logps=-torch.rand(ROWS, T, generator=g) * 2 - 6)


def reference_loss(m, b: ScoredBatch, cfg: GRPOConfig, aggregation: str, whole: bool = False) -> torch.Tensor:
    """One batch's loss in float64: full logits, log-softmax, the loss over all rows at once (bnpo and the entropy
    cut: per micro-batch, as TRL's; whole: dapo's token sum over the whole batch)."""
    L = b.input_ids.shape[1]
    att = (torch.arange(L)[None] < (b.prompt_lens + b.completion_lens)[:, None]).long()
    logp_all = torch.log_softmax(m(input_ids=b.input_ids, attention_mask=att).logits.double(), -1)
    T = int(b.completion_lens.max())
    mask = torch.arange(T)[None] < b.completion_lens[:, None]
    if b.loss_mask is not None:  # issue 32: tool-turn tokens are in the forward, not in the loss
        mask = mask & b.loss_mask
    pos = (b.prompt_lens[:, None] + torch.arange(T)[None]).clamp(max=L - 1)
    tgt = b.input_ids.gather(1, pos)
    logps = logp_all[torch.arange(ROWS)[:, None], pos - 1, tgt].masked_fill(~mask, 0.0)
    rows = torch.arange(ROWS)[:, None]
    entropy = -(logp_all.exp() * logp_all).sum(-1)[rows, pos - 1].detach()
    seq = cfg.importance_sampling_level == "sequence"
    gen = b.gen_logps.double()
    weights = None
    if cfg.old_logps == "trainer":  # π_old = the trainer's own first-pass logps, IS weights against the engine's
        weights, _ = importance_weights(logps.detach(), gen, mask, cfg.vllm_importance_sampling_mode,
                                        cfg.vllm_importance_sampling_clip_max)
        gen = logps.detach()

    def loss(r):  # the loss of rows r
        w = None if weights is None else weights[r]
        if cfg.top_entropy_quantile < 1.0:  # TRL's cut over the rows of one micro-batch (one rank here)
            em = entropy_mask(entropy[r], mask[r], cfg.top_entropy_quantile)
            w = em if w is None else w * em
        return grpo_loss(logps[r], b.ref_logps.double()[r], gen[r], b.advantages.double()[r], mask[r], beta=cfg.beta,
                         is_weights=w, bias_correction_kl=cfg.use_bias_correction_kl,
                         eps_low=cfg.gspo_eps_low if seq else cfg.eps_low,
                         eps_high=cfg.gspo_eps_high if seq else cfg.eps_high, aggregation=aggregation,
                         max_new_tokens=cfg.max_new_tokens, importance_sampling_level=cfg.importance_sampling_level)
    if cfg.top_entropy_quantile >= 1.0 and (whole or aggregation != "token_mean"):
        return loss(slice(0, ROWS))
    # TRL's bnpo and entropy cut are per micro-batch (per_device_train_batch_size = micro_batch_size rows, in order)
    parts = [slice(s, min(s + cfg.micro_batch_size, ROWS)) for s in range(0, ROWS, cfg.micro_batch_size)]
    if whole:  # dapo: the token mean over the batch's tokens, the cut per micro-batch
        return sum(loss(r) * mask[r].sum() for r in parts) / mask.sum()
    if aggregation == "token_mean":  # each micro-batch's token mean, averaged over the micro-batches
        return sum(loss(r) for r in parts) / len(parts)
    return sum(loss(r) * (r.stop - r.start) for r in parts) / ROWS


def reference_grads(model, batches: list[ScoredBatch], cfg: GRPOConfig) -> dict:
    """The update's gradient in float64: the mean of the batches' losses (grad_accum averages), except dapo,
    whose token sum is normalised by the tokens of all the update's batches (one rank: world 1)."""
    m = model.double()
    m.zero_grad()
    if cfg.aggregation == "dapo":
        tokens = [int(b.completion_lens.sum() if b.loss_mask is None else b.loss_mask.sum()) for b in batches]
        loss = sum(reference_loss(m, b, cfg, "token_mean", whole=True) * n
                   for b, n in zip(batches, tokens)) / sum(tokens)
    else:
        loss = sum(reference_loss(m, b, cfg, cfg.aggregation) for b in batches) / len(batches)
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def tiny_float32():
    """The tiny model in float32 as the engines and the float64 references start from it. Read from disk each
    time: from_pretrained of the tiny model costs ~46 ms CPU, a deepcopy of a cached one more (~78 ms, measured)."""
    return load_model(resolve_model_path("tiny"), device="cpu", dtype="float32", trainable=True)


def init_gloo(deepspeed) -> None:
    """deepspeed.init_distributed as the trainer calls it on CPU (trainer/deepspeed_policy.py init_deepspeed): without
    DeepSpeed's shared-memory op, whose gcc build (minutes on a loaded machine) the trainer skips as well."""
    skip_shm_op(deepspeed)
    deepspeed.init_distributed(dist_backend="gloo")


@pytest.fixture(scope="module")
def dist():
    """One gloo rank for every engine of this module."""
    import deepspeed
    mp = pytest.MonkeyPatch()
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(find_free_port())).items():
        mp.setenv(k, v)
    init_gloo(deepspeed)
    yield deepspeed
    torch.distributed.destroy_process_group()
    # DeepSpeed caches its clone of the world group; another module's engines (tests/test_loss_mask.py, in the same
    # pytest process) would broadcast over this destroyed group without a fresh one
    deepspeed.utils.groups._WORLD_GROUP = None
    mp.undo()


def sgd_engine(deepspeed, stage: int, grad_accum: int = 1, gradient_checkpointing: bool = False):
    """A real DeepSpeed engine on the tiny model at `stage`, plain SGD: 8-row batches in micro-batches of
    3 + 3 + 2, so DeepSpeed accumulates over 3 x grad_accum micro-batches per optimizer step. The model is made
    ready as the trainer does (trainer/deepspeed_policy.py prepare_policy: train mode, gradient checkpointing if
    asked)."""
    cfg = config("seq_mean", "token", grad_accum=grad_accum)
    cfg.gradient_checkpointing = gradient_checkpointing
    ds = ds_config_for(cfg, on_gpu=False)
    assert ds["gradient_accumulation_steps"] == 3 * grad_accum and ds["train_micro_batch_size_per_gpu"] == 3
    ds["zero_optimization"]["stage"] = stage
    ds.pop("optimizer")
    ds["zero_allow_untested_optimizer"] = True  # plain SGD: DeepSpeed tests only its own optimizers under ZeRO
    model = prepare_policy(tiny_float32(), cfg)
    params = list(model.parameters())
    eng, *_ = initialize(deepspeed, ds, model=model, model_parameters=params, optimizer=torch.optim.SGD(params, lr=LR))
    return eng


def full_weights(deepspeed, engine) -> dict:
    """Every parameter's full float64 value (gathered from its partitions under ZeRO-3)."""
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=hasattr(named[0][1], "ds_id")):
        return {n: p.detach().double().clone() for n, p in named}


@pytest.fixture(params=[0, 2, 3], ids=lambda s: f"zero{s}")
def engine(request, dist):
    """A fresh engine per case (about 2 s): SGD at lr 1 would take a shared model far from its start."""
    return sgd_engine(dist, request.param)


def config(aggregation: str, level: str, is_mode: str | None = None, grad_accum: int = 1,
           padding_free: str = "true") -> GRPOConfig:
    """is_mode None: π_old = the engine's logps (old_logps engine, the ratio is not 1); else π_old = the trainer's
    first pass with that importance-sampling correction against the engine's logps (clip_max 1.5)."""
    return GRPOConfig(model=resolve_model_path("tiny"), num_pre_Q=ROWS, micro_batch_size=3, aggregation=aggregation,
                      beta=0.04, importance_sampling_level=level, gspo_eps_low=0.01, gspo_eps_high=0.01,
                      max_new_tokens=16, logp_chunk_tokens=4, grad_clip=1e9, temperature=1.0, grad_accum=grad_accum,
                      old_logps="engine" if is_mode is None else "trainer",
                      vllm_importance_sampling_mode=is_mode or "sequence_mask",
                      vllm_importance_sampling_clip_max=1.5, padding_free=padding_free).validate()


def check_update(dist, engine, batches: list[ScoredBatch], cfg: GRPOConfig, step) -> dict:
    """Run `step` (one optimizer update) and compare the weights' change with -LR x the float64 gradient;
    returns the step's metrics."""
    assert cfg.model == resolve_model_path("tiny")  # the reference below is a copy of the tiny model
    before = full_weights(dist, engine)
    ref_model = tiny_float32()  # cfg.model is the tiny model
    ref_model.load_state_dict({n: w.float() for n, w in before.items()}, strict=False)  # buffers: its own
    want = reference_grads(ref_model, batches, cfg)
    steps_before = engine.global_steps
    stats = step()
    assert engine.global_steps == steps_before + 1  # ONE optimizer update for all the micro-batches
    after = full_weights(dist, engine)
    assert set(want) <= set(after)
    for n in want:  # float32 engine vs float64 reference: tolerance relative to each tensor's largest entry
        got = (before[n] - after[n]) / LR
        torch.testing.assert_close(got, want[n], rtol=2e-4, atol=1e-5 * float(want[n].abs().max()) + 1e-7,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return stats


@pytest.mark.parametrize("aggregation,level,is_mode", [
    ("seq_mean", "token", None), ("token_mean", "token", None), ("dr_grpo", "token", None), ("dapo", "token", None),
    ("seq_mean", "sequence", None), ("token_mean", "sequence", None), ("luspo", "sequence", None),
    ("token_mean", "token", "token_truncate"), ("seq_mean", "token", "sequence_mask")])
def test_accumulated_micro_batches_give_the_whole_batch_gradient(dist, engine, aggregation, level, is_mode):
    cfg = config(aggregation, level, is_mode)
    b = make_batch(engine.module.config.vocab_size)
    check_update(dist, engine, [b], cfg, lambda: train_step(engine, b, cfg))


@pytest.mark.parametrize("padding_free", ["true", "false"])
@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("aggregation", ["seq_mean", "dapo"])
def test_grad_accum_batches_and_micro_batches_make_one_update(dist, stage, aggregation, padding_free):
    """grad_accum 2: two batches of three micro-batches each, one update from all six (gradient checkpointing
    on, as real runs have it), packed or padded with rows grouped by length."""
    cfg = config(aggregation, "token", grad_accum=2, padding_free=padding_free)
    eng = sgd_engine(dist, stage, grad_accum=2, gradient_checkpointing=True)
    batches = [make_batch(eng.module.config.vocab_size, seed) for seed in (1, 2)]
    stats = check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))
    # which path ran, and its padding (padded tokens / computed tokens), in the step's metrics (metrics.jsonl)
    assert {"padding_share", "padding_free"} <= set(metric_keys(cfg)[0])
    assert stats["padding_free"] == (1.0 if padding_free == "true" else 0.0)
    if padding_free == "true":
        assert stats["padding_share"] == 0.0
    else:  # rows grouped by length: 0.10 here, 0.26 in row order
        assert 0 < stats["padding_share"] < 0.2


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_shared_prompt_packs_make_the_float64_update(dist, stage, monkeypatch):
    """Groups of 4 rows sharing a prompt, micro-batches of 3 (a group split across them), grad_accum 2: the packed
    forwards pack each shared prompt once (common/packing.py share_prompts, issue 62) and the update is the float64
    one, at ZeRO 0, 2 and 3."""
    from common import logprobs
    layouts = []
    real = logprobs.pack_rows
    monkeypatch.setattr(logprobs, "pack_rows", lambda *a, **kw: layouts.append(real(*a, **kw)) or layouts[-1])
    cfg = config("seq_mean", "token", grad_accum=2, padding_free="true")
    eng = sgd_engine(dist, stage, grad_accum=2, gradient_checkpointing=True)
    batches = [make_batch(eng.module.config.vocab_size, seed, groups=2) for seed in (1, 2)]
    check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))
    assert any(p.parents is not None and -1 < max(p.parents) for p in layouts)


@pytest.mark.parametrize("stage,aggregation,quantile,padding_free", [
    (0, "seq_mean", 0.5, "false"), (2, "dapo", 0.25, "true"), (3, "token_mean", 0.5, "false")])
def test_bnpo_and_entropy_cut_per_micro_batch_as_trl(dist, stage, aggregation, quantile, padding_free):
    """Issue 60: TRL's bnpo is each micro-batch's token mean (not the rank batch's; every stage: the test above),
    its top_entropy_quantile is cut per micro-batch (TRL's per_device_train_batch_size, ours micro_batch_size:
    3 + 3 + 2 rows in order; over every rank: tests/test_loss_family.py); grad_accum 2 at ZeRO 0/2/3 against the
    float64 re-derivation, padded rows kept in order."""
    cfg = config(aggregation, "token", grad_accum=2, padding_free=padding_free)
    cfg.top_entropy_quantile = quantile
    eng = sgd_engine(dist, stage, grad_accum=2)
    batches = [make_batch(eng.module.config.vocab_size, seed) for seed in (1, 2)]
    stats = check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))
    if quantile < 1.0:
        assert 0 < stats["entropy_kept_share"] < 1


# Two real ZeRO-3 ranks make the ZeRO-0 update: tests/test_pack_bound.py (test_two_zero3_ranks_make_the_zero0_update),
# in the same 2-rank launch as its packed case.


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("level,is_mode", [("token", None), ("sequence", None), ("token", "token_truncate")])
def test_bias_corrected_kl_update_matches_float64(dist, stage, level, is_mode):
    """Issue 40: use_bias_correction_kl (TRL: the KL term times the importance ratio) through micro-batches and
    grad_accum 2 at ZeRO 0/2/3 equals the float64 gradient, and differs from the uncorrected update."""
    cfg = config("seq_mean", level, is_mode, grad_accum=2)
    cfg.use_bias_correction_kl, cfg.beta = True, 0.5
    eng = sgd_engine(dist, stage, grad_accum=2)
    batches = [make_batch(eng.module.config.vocab_size, seed) for seed in (1, 2)]
    ref_model = tiny_float32()
    ref_model.load_state_dict({n: w.float() for n, w in full_weights(dist, eng).items()}, strict=False)
    plain = reference_grads(ref_model, batches, dataclasses.replace(cfg, use_bias_correction_kl=False))
    ref_model.zero_grad()
    corrected = reference_grads(ref_model, batches, cfg)
    assert max(float((plain[n] - corrected[n]).abs().max() / corrected[n].abs().max()) for n in plain) > 1e-3
    check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))


def with_tool_turns(b: ScoredBatch) -> ScoredBatch:
    """b with a loss mask (issue 32): a tool turn of up to 3 tokens after each completion's first 2 tokens (rows of
    3+ tokens), out of the loss. Engine and reference logprobs there are made far from the policy's (-0.05: near
    certainty), so any term or normaliser that still counted them would move the update visibly."""
    T = int(b.completion_lens.max())
    lm = torch.arange(T)[None] < b.completion_lens[:, None]
    for i, c in enumerate(b.completion_lens.tolist()):
        if c >= 3:
            lm[i, 2:min(5, c)] = False
    tool = (torch.arange(T)[None] < b.completion_lens[:, None]) & ~lm
    b.gen_logps = b.gen_logps.masked_fill(tool, -0.05)
    b.ref_logps = b.ref_logps.masked_fill(tool, -0.05)
    b.loss_mask = lm
    return b


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("aggregation,level,is_mode,padding_free", [
    ("dapo", "token", None, "true"), ("seq_mean", "sequence", "sequence_mask", "false")])
def test_loss_mask_keeps_tool_tokens_out_of_the_update(dist, stage, aggregation, level, is_mode, padding_free):
    """Issue 32: batches with tool turns (loss_mask), grad_accum 2 x three micro-batches, packed or padded: the
    update is the float64 gradient of the loss over the sampled tokens only (dapo's token count included)."""
    cfg = config(aggregation, level, is_mode, grad_accum=2, padding_free=padding_free)
    eng = sgd_engine(dist, stage, grad_accum=2)
    batches = [with_tool_turns(make_batch(eng.module.config.vocab_size, seed)) for seed in (1, 2)]
    assert all(0 < int((~b.loss_mask & b.completion_mask()).sum()) for b in batches)
    check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))


def test_split_keeps_the_loss_mask_row_aligned():
    """The loss mask ANDed into the completion mask (trainer/objective/update.py new_round) reaches each
    micro-batch on its own rows, in row order and grouped by length, and joins back to the batch's."""
    b = with_tool_turns(make_batch(100))
    cfg = config("token_mean", "token")
    mask = new_round([b], cfg, "cpu").masks[0]
    assert torch.equal(mask, b.completion_mask() & b.loss_mask)
    for by_length in (False, True):
        parts = microbatch.split(b, mask, b.advantages, b.gen_logps, b.ref_logps, 3, "token_mean", by_length)
        for p in parts:
            assert torch.equal(p.mask, b.loss_mask[p.rows, :p.mask.shape[1]])
        assert sum(p.weight for p in parts) == pytest.approx(1.0)
        assert torch.equal(microbatch.join([p.mask.float() for p in parts], parts, ROWS, mask.shape[1]).bool(), mask)


def test_weights_add_up_to_one():
    b = make_batch(100)
    mask = b.completion_mask()
    for agg in ("seq_mean", "token_mean", "dr_grpo", "dapo"):
        parts = microbatch.split(b, mask, b.advantages, b.gen_logps, b.ref_logps, 3, agg)
        assert [p.rows for p in parts] == [slice(0, 3), slice(3, 6), slice(6, 8)]
        assert sum(p.weight for p in parts) == pytest.approx(1.0)
        assert all(p.mask.shape[1] == int(b.completion_lens[p.rows].max()) for p in parts)


def test_knob_and_trl_alias():
    from common.settings.knobs import from_dict
    assert from_dict(GRPOConfig, {"per_device_train_batch_size": 4}).micro_batch_size == 4
    with pytest.raises(ValueError, match="micro_batch_size"):
        GRPOConfig(micro_batch_size=-1).validate()


def test_rows_grouped_by_length_keep_the_weights():
    """padding_free false: micro-batches of rows of similar length; the loss weights still add up to one and the
    micro-batches pad less than in row order."""
    b = make_batch(100)
    mask = b.completion_mask()
    lens = b.prompt_lens + b.completion_lens
    for agg in ("seq_mean", "token_mean", "dr_grpo", "dapo"):
        plain = microbatch.split(b, mask, b.advantages, b.gen_logps, b.ref_logps, 3, agg)
        parts = microbatch.split(b, mask, b.advantages, b.gen_logps, b.ref_logps, 3, agg, by_length=True)
        assert sorted(i for p in parts for i in p.rows.tolist()) == list(range(ROWS))
        assert sum(p.weight for p in parts) == pytest.approx(1.0)
        assert [int(lens[p.rows].max()) for p in parts] == sorted(int(lens[p.rows].max()) for p in parts)
        width = lambda ps: sum(p.input_ids.numel() for p in ps)  # noqa: E731  (tokens the forwards compute)
        assert width(parts) < width(plain)
        joined = microbatch.join([p.mask.float() for p in parts], parts, ROWS, mask.shape[1])
        assert torch.equal(joined.bool(), mask)
