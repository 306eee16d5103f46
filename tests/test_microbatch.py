"""Micro-batches (trainer/objective/microbatch.py): the gradient DeepSpeed accumulates over a step's
micro-batches equals the whole batch's gradient, for every aggregation and for GSPO, checked against a float64
re-derivation (a plain full-logits forward of a float64 copy of the model, no chunking, no DeepSpeed)."""
from __future__ import annotations

import pytest
import torch
from conftest import find_free_port

from common.config import GRPOConfig
from common.modeling import load_model, resolve_model_path
from common.protocol import ScoredBatch
from trainer.engine import ds_config_for
from trainer.objective import microbatch
from trainer.objective.grpo import grpo_loss
from trainer.objective.offpolicy import importance_weights
from trainer.objective.update import train_step

ROWS = 8


def make_batch(vocab: int) -> ScoredBatch:
    g = torch.Generator().manual_seed(0)
    plen = torch.tensor([3, 5, 4, 6, 3, 2, 5, 4])
    clen = torch.tensor([7, 2, 9, 4, 1, 6, 3, 8])  # ragged: micro-batches have their own widths
    ids = torch.zeros(ROWS, int((plen + clen).max()), dtype=torch.long)
    for i in range(ROWS):
        ids[i, :plen[i] + clen[i]] = torch.randint(3, vocab, (int(plen[i] + clen[i]),), generator=g)
    T = int(clen.max())
    return ScoredBatch(ids, plen, clen, torch.randn(ROWS, generator=g),
                       gen_logps=-torch.rand(ROWS, T, generator=g) * 2 - 6,
                       ref_logps=-torch.rand(ROWS, T, generator=g) * 2 - 6)


def reference_grads(model, b: ScoredBatch, cfg: GRPOConfig) -> dict:
    """Whole-batch gradient in float64: full logits, log-softmax, the loss over all rows at once."""
    m = model.double()
    m.zero_grad()
    L = b.input_ids.shape[1]
    att = (torch.arange(L)[None] < (b.prompt_lens + b.completion_lens)[:, None]).long()
    logp_all = torch.log_softmax(m(input_ids=b.input_ids, attention_mask=att).logits.double(), -1)
    T = int(b.completion_lens.max())
    mask = torch.arange(T)[None] < b.completion_lens[:, None]
    pos = (b.prompt_lens[:, None] + torch.arange(T)[None]).clamp(max=L - 1)
    tgt = b.input_ids.gather(1, pos)
    logps = logp_all[torch.arange(ROWS)[:, None], pos - 1, tgt].masked_fill(~mask, 0.0)
    seq = cfg.importance_sampling_level == "sequence"
    gen = b.gen_logps.double()
    weights = None
    if cfg.old_logps == "trainer":  # π_old = the trainer's own first-pass logps, IS weights against the engine's
        weights, _ = importance_weights(logps.detach(), gen, mask, cfg.vllm_importance_sampling_mode,
                                        cfg.vllm_importance_sampling_clip_max)
        gen = logps.detach()
    loss = grpo_loss(logps, b.ref_logps.double(), gen, b.advantages.double(), mask, beta=cfg.beta, is_weights=weights,
                     eps_low=cfg.gspo_eps_low if seq else cfg.eps_low,
                     eps_high=cfg.gspo_eps_high if seq else cfg.eps_high,
                     aggregation="token_mean" if cfg.aggregation == "dapo" else cfg.aggregation,
                     max_new_tokens=cfg.max_new_tokens, importance_sampling_level=cfg.importance_sampling_level)
    loss.backward()  # dapo on one rank: local tokens x world / global tokens = 1
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def engine():
    """One real DeepSpeed engine (stage 0, one gloo rank) on the tiny model: 8-row batches in micro-batches of
    3 + 3 + 2, so DeepSpeed accumulates over 3 micro-batches per optimizer step."""
    import deepspeed
    mp = pytest.MonkeyPatch()
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(find_free_port())).items():
        mp.setenv(k, v)
    deepspeed.init_distributed(dist_backend="gloo")
    ds = ds_config_for(config("seq_mean", "token"), on_gpu=False)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_micro_batch_size_per_gpu"] == 3
    ds["zero_optimization"]["stage"] = 0
    model = load_model(resolve_model_path("tiny"), device="cpu", dtype="float32", trainable=True)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    eng.grads = {}  # the accumulated gradient of each parameter, as it stands just before the optimizer step
    for n, p in eng.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: eng.grads.__setitem__(n, p.grad.detach().double().clone()))
    yield eng
    torch.distributed.destroy_process_group()
    mp.undo()


def config(aggregation: str, level: str, is_mode: str | None = None) -> GRPOConfig:
    """is_mode None: π_old = the engine's logps (old_logps engine, the ratio is not 1); else π_old = the trainer's
    first pass with that importance-sampling correction against the engine's logps (clip_max 1.5)."""
    return GRPOConfig(model=resolve_model_path("tiny"), num_pre_Q=ROWS, micro_batch_size=3, aggregation=aggregation,
                      beta=0.04, importance_sampling_level=level, gspo_eps_low=0.01, gspo_eps_high=0.01,
                      max_new_tokens=16, logp_chunk_tokens=4, grad_clip=1e9, temperature=1.0,
                      old_logps="engine" if is_mode is None else "trainer",
                      vllm_importance_sampling_mode=is_mode or "sequence_mask",
                      vllm_importance_sampling_clip_max=1.5).validate()


@pytest.mark.parametrize("aggregation,level,is_mode", [
    ("seq_mean", "token", None), ("token_mean", "token", None), ("dr_grpo", "token", None), ("dapo", "token", None),
    ("seq_mean", "sequence", None), ("token_mean", "sequence", None), ("luspo", "sequence", None),
    ("token_mean", "token", "token_truncate"), ("seq_mean", "token", "sequence_mask")])
def test_accumulated_micro_batches_give_the_whole_batch_gradient(engine, aggregation, level, is_mode):
    cfg = config(aggregation, level, is_mode)
    ref_model = load_model(cfg.model, device="cpu", dtype="float32", trainable=True)
    ref_model.load_state_dict(engine.module.state_dict())  # the engine's current weights (earlier cases stepped)
    b = make_batch(ref_model.config.vocab_size)
    want = reference_grads(ref_model, b, cfg)
    engine.grads.clear()
    steps_before = engine.global_steps
    train_step(engine, b, cfg)
    assert engine.global_steps == steps_before + 1  # ONE optimizer update for the three micro-batches
    assert set(engine.grads) == set(want)
    for n in want:  # float32 engine vs float64 reference: tolerance relative to each tensor's largest entry
        torch.testing.assert_close(engine.grads[n], want[n], rtol=2e-4, atol=1e-5 * float(want[n].abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_weights_add_up_to_one():
    b = make_batch(100)
    mask = b.completion_mask()
    for agg in ("seq_mean", "token_mean", "dr_grpo", "dapo"):
        parts = microbatch.split(b, mask, b.advantages, b.gen_logps, b.ref_logps, 3, agg)
        assert [p.rows for p in parts] == [slice(0, 3), slice(3, 6), slice(6, 8)]
        assert sum(p.weight for p in parts) == pytest.approx(1.0)
        assert all(p.mask.shape[1] == int(b.completion_lens[p.rows].max()) for p in parts)


def test_knob_and_trl_alias():
    from common.knobs import from_dict
    assert from_dict(GRPOConfig, {"per_device_train_batch_size": 4}).micro_batch_size == 4
    with pytest.raises(ValueError, match="micro_batch_size"):
        GRPOConfig(micro_batch_size=-1).validate()
