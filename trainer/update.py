"""One training step = one optimizer update.

A generation round gives each rank `grad_accum` training batches (micro-steps whose gradients DeepSpeed
accumulates into one update); the round is trained for `mu` consecutive steps (TRL's num_iterations), so
with grad_accum 2 and mu 2:

    step 1: fetch B1, B2 (policy v0) - pass 1 over B1, B2 - update -> v1   (ratio 1: π_old = these logps)
    step 2:                            pass 2 over B1, B2 - update -> v2   (ratio against pass 1's logps)
    step 3: fetch B3, B4 (policy <= v2) ...

Steps, the LR schedule (trainer/engine.py), policy versions, staleness, publishes, metrics rows and
checkpoints all count updates. π_old is the trainer's first-pass logprobs (`old_logps: trainer`, the
default) with the engine's logprobs used only for the importance-sampling correction (trainer/offpolicy.py);
`old_logps: engine` keeps the former objective (ratio against the engine's logprobs, no correction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.config import GRPOConfig
from common.logprobs import sequence_logprobs
from common.protocol import ProtocolError, ScoredBatch
from trainer.grpo import entropy_mask, grpo_loss, loss_stats, mismatch_stats, reinforce_pp_advantages
from trainer.offpolicy import importance_weights, in_band_share, off_policy_mask

COUNT_KEYS = {"is_uncorrected_batches"}  # summed over a step's batches, not averaged


def metric_keys(cfg: GRPOConfig) -> tuple[list[str], list[str]]:
    """(mean, sum) metric keys this config's steps report, beyond the common ones (step_metrics.MEAN_KEYS)."""
    mean, total = [], []
    if cfg.old_logps == "trainer" and cfg.vllm_importance_sampling_correction and cfg.compute_gen_logps:
        mean += ["is_weight_mean", "is_masked_share"]
        total += ["is_uncorrected_batches"]
    if cfg.off_policy_mask_threshold is not None:
        mean += ["off_policy_masked_share"]
    if cfg.top_entropy_quantile < 1.0:
        mean += ["entropy_kept_share"]
    if cfg.importance_sampling_level == "sequence":
        mean += ["gspo_in_band"] + (["gspo_in_band_engine"] if cfg.compute_gen_logps else [])
    if cfg.mu > 1:
        mean += ["round_pass"]
    if cfg.beta == 0:
        total += ["ref_skipped_batches"]  # fetched batches the ref server served without a reference forward
    return mean, total


def starts_round(step: int, start_step: int, mu: int) -> bool:
    """Whether update `step` (1-based) fetches new batches: every mu-th step counted from the run's (or the
    resume's) first step. A resume always starts a new round (the old round's batches are not checkpointed)."""
    return (step - start_step - 1) % mu == 0


@dataclass
class Round:
    """This rank's batches of one generation round and what their first pass fixed (π_old, IS weights)."""
    batches: list[ScoredBatch]
    masks: list[torch.Tensor] = field(default_factory=list)
    advs: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # dapo normaliser per micro-batch
    old: list[torch.Tensor | None] = field(default_factory=list)
    weights: list[torch.Tensor | None] = field(default_factory=list)
    first_stats: list[dict] = field(default_factory=list)  # IS diagnostics of the first pass, per batch
    passes: int = 0


def truncated_mask(b: ScoredBatch) -> torch.Tensor:
    """extra['truncated'] as a (B,) bool tensor, checked: one bool per completion (never crash a rank on it)."""
    tr = b.extra["truncated"]
    n = int(b.input_ids.shape[0])
    if not isinstance(tr, list) or len(tr) != n or not all(isinstance(x, bool) for x in tr):
        raise ProtocolError(f"scored batch {b.batch_id}: extra['truncated'] must be a list of {n} booleans")
    return torch.tensor(tr, dtype=torch.bool)


def new_round(batches: list[ScoredBatch], cfg: GRPOConfig, device) -> Round:
    """Masks, advantages and normalisers of the round, fixed once (collectives: every rank calls this)."""
    rnd = Round(batches)
    for b in batches:
        mask = b.completion_mask().to(device)
        if cfg.mask_truncated and "truncated" in b.extra:
            mask = mask & ~truncated_mask(b).to(device)[:, None]
        rnd.masks.append(mask)
    advs = [b.advantages.to(device) for b in batches]
    if cfg.advantage_mode == "reinforce_pp":  # group-centred at generation; normalised over the step's batches
        flat = reinforce_pp_advantages(torch.cat(advs), all_reduce=torch.distributed.all_reduce
                                       if torch.distributed.is_initialized() else None)
        advs = list(flat.split([len(a) for a in advs]))
    rnd.advs = advs
    rnd.scales = dapo_scales(rnd.masks) if cfg.aggregation == "dapo" else [1.0] * len(batches)
    return rnd


def dapo_scales(masks: list[torch.Tensor]) -> list[float]:
    """TRL's dapo: token sum / the token count of the whole update (all micro-batches, all ranks). DeepSpeed
    averages gradients over ranks and divides each micro-step's loss by grad_accum, so a micro-batch's
    token_mean (sum / its tokens) is scaled by its tokens * world * grad_accum / all tokens."""
    local = [m.sum().to(torch.float64).cpu() for m in masks]
    total = torch.stack(local).sum()
    world = 1
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
        world = torch.distributed.get_world_size()
    return [float(n * world * len(masks) / total.clamp(min=1)) for n in local]


def train_update(engine, rnd: Round, cfg: GRPOConfig) -> dict:
    """One optimizer update: one pass over the round's batches (DeepSpeed steps at the last micro-batch)."""
    rows = [_micro_step(engine, rnd, i, cfg) for i in range(len(rnd.batches))]
    rnd.passes += 1
    out = {}
    for k in set().union(*rows):  # a key only some batches have (no engine logprobs) averages over those
        vals = [r[k] for r in rows if k in r]
        out[k] = sum(vals) if k in COUNT_KEYS else sum(vals) / len(vals)
    return out


def _micro_step(engine, rnd: Round, i: int, cfg: GRPOConfig) -> dict:
    b, mask, adv = rnd.batches[i], rnd.masks[i], rnd.advs[i]
    device = mask.device
    gen = b.gen_logps.to(device) if (cfg.compute_gen_logps and b.gen_logps is not None) else None
    ref = b.ref_logps.to(device) if cfg.beta > 0 else None
    level = cfg.importance_sampling_level
    eps = dict(eps_low=cfg.gspo_eps_low, eps_high=cfg.gspo_eps_high) if level == "sequence" else \
        dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    logps, ent = sequence_logprobs(engine.module, b.input_ids, b.prompt_lens, b.completion_lens,
                                   chunk_tokens=cfg.logp_chunk_tokens, with_entropy=True,
                                   temperature=cfg.logprob_temperature())
    logps = logps.float()
    if rnd.passes == 0:
        old, w, first = first_pass(logps, gen, mask, cfg, b.batch_id)
        if level == "sequence" and gen is not None:  # how many completions the engine's π_old leaves in the band
            first["gspo_in_band_engine"] = in_band_share(logps, gen, mask, **eps)
        rnd.old.append(old)
        rnd.weights.append(w)
        rnd.first_stats.append(first)
    old, w = rnd.old[i], rnd.weights[i]
    opsm: dict = {}
    if cfg.off_policy_mask_threshold is not None:  # against the current policy, every pass (as TRL)
        keep, opsm["off_policy_masked_share"] = off_policy_mask(adv, logps, gen if gen is not None else old, mask,
                                                                cfg.off_policy_mask_threshold)
        w = keep.expand_as(logps) if w is None else w * keep
    if cfg.top_entropy_quantile < 1.0:  # only the high-entropy tokens of this batch train the policy term
        em = entropy_mask(ent, mask, cfg.top_entropy_quantile)
        w = em if w is None else w * em
        opsm["entropy_kept_share"] = float(em.sum() / mask.sum().clamp(min=1))
    objective = dict(objective=cfg.objective(), sapo_tau=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))
    loss = grpo_loss(logps, ref, old, adv, mask, beta=cfg.beta,
                     aggregation="token_mean" if cfg.aggregation == "dapo" else cfg.aggregation,
                     max_new_tokens=cfg.max_new_tokens, importance_sampling_level=level, is_weights=w, **eps,
                     **objective)
    loss = loss * rnd.scales[i]
    engine.backward(loss)
    engine.step()
    stats = loss_stats(logps, ref, old, adv, mask, importance_sampling_level=level, objective=cfg.objective(), **eps)
    if level == "sequence":
        stats["gspo_in_band"] = in_band_share(logps, old, mask, **eps) if old is not None else 1.0
    m = mask.float()
    stats["entropy"] = float((ent * m).sum() / m.sum().clamp(min=1))
    stats["loss"] = float(loss.detach())
    if gen is not None:  # train/inference mismatch (includes policy drift when the batch is stale)
        stats.update(mismatch_stats(logps, gen, mask))
    return {**stats, **rnd.first_stats[i], **opsm}


def first_pass(logps: torch.Tensor, gen: torch.Tensor | None, mask: torch.Tensor, cfg: GRPOConfig, batch_id: str
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """π_old and the per-token weights this batch keeps for all its mu passes, with their diagnostics."""
    stats: dict = {}
    if cfg.old_logps == "engine":
        if gen is None:
            raise ValueError(f"old_logps=engine takes π_old from the engine's logprobs, but batch {batch_id} has "
                             f"none (compute_gen_logps false, or a producer that sent none); use old_logps=trainer")
        return gen, None, stats
    old = logps.detach()
    weight = None
    if cfg.vllm_importance_sampling_correction and gen is not None:
        weight, stats = importance_weights(old, gen, mask, cfg.vllm_importance_sampling_mode,
                                           cfg.vllm_importance_sampling_clip_max,
                                           cfg.vllm_importance_sampling_clip_min)
    elif cfg.vllm_importance_sampling_correction and cfg.compute_gen_logps:
        stats["is_uncorrected_batches"] = 1.0  # a producer sent no engine logprobs: counted, never silent
    return old, weight, stats
