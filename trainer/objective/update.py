"""One training step = one optimizer update.

A generation round gives each rank `grad_accum` training batches (micro-steps whose gradients DeepSpeed
accumulates into one update); the round is trained for `mu` consecutive steps (TRL's num_iterations), so
with grad_accum 2 and mu 2:

    step 1: fetch B1, B2 (policy v0) - pass 1 over B1, B2 - update -> v1   (ratio 1: π_old = these logps)
    step 2:                            pass 2 over B1, B2 - update -> v2   (ratio against pass 1's logps)
    step 3: fetch B3, B4 (policy <= v2) ...

Steps, the LR schedule (trainer/deepspeed_policy.py), policy versions, staleness, publishes, metrics rows and
checkpoints all count updates. π_old is the trainer's first-pass logprobs (`old_logps: trainer`, the
default) with the engine's logprobs used only for the importance-sampling correction (trainer/objective/offpolicy.py);
`old_logps: engine` keeps the former objective (ratio against the engine's logprobs, no correction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.config import GRPOConfig
from common.logprobs import forward_calls, sequence_logprobs
from common.pack_choice import choose_packed
from common.packing import forward_tokens, padding_share
from common.wire.protocol import ProtocolError, ScoredBatch
from trainer.dist import comm
from trainer.dist.engine_call import engine_forward
from trainer.objective import microbatch
from trainer.objective.grpo import entropy_mask, grpo_loss, loss_stats, mismatch_stats, reinforce_pp_advantages
from trainer.objective.microbatch import micro_batches_per_step, rows_per_step
from trainer.objective.offpolicy import importance_weights, in_band_share, off_policy_mask

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
    mean += ["padding_share", "padding_free"]  # padded / computed tokens; 1 = packed forwards, 0 = padded
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
    old: list[list] = field(default_factory=list)  # per batch, per micro-batch: π_old (None = the engine's)
    weights: list[list] = field(default_factory=list)  # per batch, per micro-batch: IS weights or None
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
        # The loss mask (tool turns' tokens: in the sequence, out of the loss) ANDed in here, once: every term
        # after this sees only trained tokens through this mask: the policy term and its aggregations, the KL term,
        # pi_old and the IS weights (token and sequence level), the off-policy and entropy masks, the dapo_scales
        # token counts (all micro-batches, all ranks), micro-batch weights, and the loss_stats / mismatch / entropy
        # metrics. Metrics that count ALL completion tokens (model + tool): completion_len (trainer/run/step_metrics.py)
        # and tokens_per_s (trainer/loop.py), which measure what was generated and forwarded, not what trained.
        if b.loss_mask is not None:
            mask = mask & b.loss_mask.to(device=device, dtype=torch.bool)
        if cfg.mask_truncated and "truncated" in b.extra:
            mask = mask & ~truncated_mask(b).to(device)[:, None]
        rnd.masks.append(mask)
    advs = [b.advantages.to(device) for b in batches]
    if cfg.advantage_mode == "reinforce_pp":  # group-centred at generation; normalised over the step's batches
        flat = reinforce_pp_advantages(torch.cat(advs), all_reduce=comm.all_reduce
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
        comm.all_reduce(total)  # on the group's device (NCCL: CUDA), see trainer/dist/comm.py
        world = torch.distributed.get_world_size()
    return [float(n * world * len(masks) / total.clamp(min=1)) for n in local]


def train_update(engine, rnd: Round, cfg: GRPOConfig) -> dict:
    """One optimizer update: one pass over the round's batches, each in micro-batches of micro_batch_size rows
    (trainer/objective/microbatch.py); DeepSpeed steps the optimizer at the last micro-batch of the last batch."""
    rows = [_batch_step(engine, rnd, i, cfg) for i in range(len(rnd.batches))]
    rnd.passes += 1
    out = {}
    for k in set().union(*rows):  # a key only some batches have (no engine logprobs) averages over those
        vals = [r[k] for r in rows if k in r]
        out[k] = sum(vals) if k in COUNT_KEYS else sum(vals) / len(vals)
    return out


def train_step(engine, b: ScoredBatch, cfg: GRPOConfig) -> dict:
    """One update on one batch (a round of one batch, first pass): for probes and tests."""
    return train_update(engine, new_round([b], cfg, next(engine.module.parameters()).device), cfg)


def agreed_calls(model, mb: microbatch.Micro, cfg: GRPOConfig, packed: bool = False) -> tuple[int, int]:
    """(packs, head calls per pack) every rank makes under ZeRO-3, where each module call gathers its weights
    from every rank: as many packed forwards (padding_free, at most pack_tokens tokens each) and LM-head calls
    as the rank with the most (common/logprobs.py adds dummy packs and empty chunks). (0, 0) otherwise."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return 0, 0
    packs, chunks = forward_calls(mb.prompt_lens, mb.completion_lens, cfg.logp_chunk_tokens, packed, cfg.pack_tokens)
    return comm.all_reduce_int(packs, "max"), comm.all_reduce_int(chunks, "max")


def _eps(cfg: GRPOConfig) -> dict:
    """The clip of this level: gspo_eps_* at sequence level (TRL's epsilon/epsilon_high set them too: aliases).
    CISPO's cap is epsilon_high (eps_high) at either level, as TRL's: GSPO's 4e-4 would cap every weight."""
    if cfg.importance_sampling_level == "sequence":
        high = cfg.eps_high if cfg.objective() == "cispo" else cfg.gspo_eps_high
        return dict(eps_low=cfg.gspo_eps_low, eps_high=high)
    return dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high)


def _batch_step(engine, rnd: Round, i: int, cfg: GRPOConfig) -> dict:
    """One pass over batch i, micro-batch by micro-batch; returns the batch's diagnostics."""
    b, mask, adv = rnd.batches[i], rnd.masks[i], rnd.advs[i]
    device = mask.device
    gen = b.gen_logps.to(device) if (cfg.compute_gen_logps and b.gen_logps is not None) else None
    ref = b.ref_logps.to(device) if cfg.beta > 0 else None
    packed = choose_packed(cfg.padding_free, engine.module, b.prompt_lens, b.completion_lens,  # auto: the ranks'
                           cfg.micro_batch_size or b.num_rows, cfg.pack_tokens,           # summed estimates,
                           comm.all_reduce if torch.distributed.is_initialized() else None)  # one choice
    micros = microbatch.split(b, mask, adv, gen, ref, cfg.micro_batch_size or b.num_rows, cfg.aggregation,
                              by_length=not packed and not microbatch.per_micro(cfg))
    if len(micros) != micro_batches_per_step(cfg):  # DeepSpeed's accumulation boundary counts micro-batches
        raise ValueError(f"training batch of {b.num_rows} rows makes {len(micros)} micro-batches of "
                         f"micro_batch_size={cfg.micro_batch_size}; train_batch_groups x num_pre_Q = "
                         f"{rows_per_step(cfg)} rows make {micro_batches_per_step(cfg)}")
    first = rnd.passes == 0
    if first:
        rnd.old.append([None] * len(micros))
        rnd.weights.append([None] * len(micros))
    seen, kept = [], []
    for j, mb in enumerate(micros):
        packs, chunks = agreed_calls(engine.module, mb, cfg, packed)
        # through engine(): DeepSpeed's per-micro-batch bookkeeping (ZeRO-3 accumulates only then), see engine_call
        logps, ent = engine_forward(engine, lambda mb=mb, packs=packs, chunks=chunks: sequence_logprobs(
            engine.module, mb.input_ids, mb.prompt_lens, mb.completion_lens, chunk_tokens=cfg.logp_chunk_tokens,
            with_entropy=True, min_chunks=chunks, temperature=cfg.logprob_temperature(), padding_free=packed,
            pack_tokens=cfg.pack_tokens, min_packs=packs))
        logps = logps.float()
        if first:  # π_old and the IS weights, fixed for all mu passes (row-local: exact per micro-batch)
            rnd.old[i][j], rnd.weights[i][j], _ = first_pass(logps, mb.gen, mb.mask, cfg, b.batch_id)
        loss, em = _micro_loss(logps, ent, mb, rnd.old[i][j], rnd.weights[i][j], cfg)
        loss = loss * (rnd.scales[i] * mb.weight)
        engine.backward(loss * microbatch.backward_scale(len(micros)))
        engine.step()  # an optimizer update only after the update's last micro-batch (trainer/deepspeed_policy.py)
        seen.append((logps.detach(), ent, float(loss.detach())))
        kept.append(em)
    stats = _batch_stats(seen, kept, micros, rnd, i, gen, ref, cfg)
    return {**stats, "padding_share": micro_padding_share(micros, packed), "padding_free": float(packed)}


def micro_padding_share(micros: list[microbatch.Micro], packed: bool) -> float:
    """Padded tokens / computed tokens over the batch's micro-batch forwards."""
    counts = [forward_tokens(mb.prompt_lens, mb.completion_lens, packed) for mb in micros]
    return padding_share(sum(c for c, _ in counts), sum(r for _, r in counts))


def _micro_loss(logps, ent, mb: microbatch.Micro, old, w, cfg: GRPOConfig):
    """The loss of one micro-batch, normalised within it (the caller weights it into the batch's loss), and
    the entropy mask it used (None without top_entropy_quantile)."""
    if cfg.off_policy_mask_threshold is not None:  # against the current policy, every pass (as TRL)
        keep, _ = off_policy_mask(mb.adv, logps, mb.gen if mb.gen is not None else old, mb.mask,
                                  cfg.off_policy_mask_threshold)
        w = keep.expand_as(logps) if w is None else w * keep
    em = None
    if cfg.top_entropy_quantile < 1.0:  # only the high-entropy tokens train the policy term: TRL's cut, per
        em = entropy_mask(ent, mb.mask, cfg.top_entropy_quantile,  # micro-batch over every rank (a collective:
                          comm.all_gather_values if torch.distributed.is_initialized() else None)  # same count)
        w = em if w is None else w * em
    objective = dict(objective=cfg.objective(), sapo_tau=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))
    loss = grpo_loss(logps, mb.ref, old, mb.adv, mb.mask, beta=cfg.beta,
                     aggregation="token_mean" if cfg.aggregation == "dapo" else cfg.aggregation,
                     max_new_tokens=cfg.max_new_tokens, importance_sampling_level=cfg.importance_sampling_level,
                     is_weights=w, bias_correction_kl=cfg.use_bias_correction_kl, **_eps(cfg), **objective)
    return loss, em


def _batch_stats(seen: list, kept: list, micros: list, rnd: Round, i: int, gen, ref, cfg: GRPOConfig) -> dict:
    """Whole-batch diagnostics from its micro-batches: KL, clipping, entropy, loss, mismatch, IS weights."""
    mask, adv = rnd.masks[i], rnd.advs[i]
    B, T = mask.shape
    logps = microbatch.join([s[0] for s in seen], micros, B, T)
    ent = microbatch.join([s[1] for s in seen], micros, B, T)
    olds = rnd.old[i]
    old = None if olds[0] is None else microbatch.join(olds, micros, B, T)
    level, eps = cfg.importance_sampling_level, _eps(cfg)
    if rnd.passes == 0:  # the first pass's IS diagnostics over the whole batch, kept for its later passes
        _, _, first = first_pass(old if old is not None else logps, gen, mask, cfg, rnd.batches[i].batch_id)
        if level == "sequence" and gen is not None:  # how many completions the engine's π_old leaves in the band
            first["gspo_in_band_engine"] = in_band_share(logps, gen, mask, **eps)
        rnd.first_stats.append(first)
    stats = loss_stats(logps, ref, old, adv, mask, importance_sampling_level=level, objective=cfg.objective(), **eps)
    if level == "sequence":
        stats["gspo_in_band"] = in_band_share(logps, old, mask, **eps) if old is not None else 1.0
    m = mask.float()
    stats["entropy"] = float((ent * m).sum() / m.sum().clamp(min=1))
    stats["loss"] = sum(s[2] for s in seen)  # the weighted micro losses add up to the batch's loss
    if gen is not None:  # train/inference mismatch (includes policy drift when the batch is stale)
        stats.update(mismatch_stats(logps, gen, mask))
    if cfg.off_policy_mask_threshold is not None:
        _, stats["off_policy_masked_share"] = off_policy_mask(adv, logps, gen if gen is not None else old, mask,
                                                              cfg.off_policy_mask_threshold)
    if kept[0] is not None:
        stats["entropy_kept_share"] = float(microbatch.join(kept, micros, B, T).sum() / mask.sum().clamp(min=1))
    return {**stats, **rnd.first_stats[i]}


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
