"""The GRPO objective: group advantages and one pure loss function.

    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3(ref || policy)

with r = exp(logp - old_logp) per token, aggregated over completion tokens only. old_logp is π_old: the
trainer's own first-pass logprobs by default (trainer/objective/update.py), or the engine's (old_logps=engine); None
gives the REINFORCE form exp(logp - logp.detach()) (value 1, the gradient of logp). Importance weights on the
policy term (engine mismatch / staleness, trainer/objective/offpolicy.py) come in as is_weights.

Variants (each a config value):
- importance_sampling_level="sequence": GSPO (Zheng et al. 2025, arXiv:2507.18071). One ratio per completion,
  s_i = exp(mean_t(logp - old_logp)) (the length-normalised sequence log-ratio), clipped per sequence with its own
  small epsilons (the paper uses 3e-4 / 4e-4); it is broadcast over the completion's tokens, so the aggregation
  and the per-token k3 KL work unchanged (as in TRL).
- advantage_mode="reinforce_pp": REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): the group mean is
  subtracted at generation time, the result is normalised over the whole training batch (all ranks) at train time.
- objective="cispo": CISPO (MiniMax-M1, arXiv:2506.13585): -sg(min(r, eps_high)) * A * logp, the clipped IS
  weight without a gradient, so no token loses its gradient (eps_high is the absolute cap here, as TRL's).
- objective="sapo": SAPO (soft adaptive policy optimisation): -sigmoid(tau * (r - 1)) * 4 / tau * A, a smooth gate
  instead of the hard clip, tau = sapo_tau_pos for A > 0 and sapo_tau_neg otherwise (TRL's formula).
- aggregation="luspo": LUSPO (GSPO with length scaling): each completion's loss is summed over its tokens, then
  averaged over completions (TRL: (per_token_loss * len).mean() with a sequence-level ratio).
- overlong shaping: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), a linear reward
  penalty for completions that enter the last `overlong_buffer` tokens before max_new_tokens.
- bias_correction_kl (TRL's use_bias_correction_kl): beta * r * KL_k3 instead of beta * KL_k3.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean", "token_mean", "dr_grpo", "luspo")
IS_LEVELS = ("token", "sequence")
OBJECTIVES = ("clip", "cispo", "sapo")


def group_advantages(rewards: torch.Tensor, mode: str = "grpo", eps: float = 1e-4) -> torch.Tensor:
    """Rewards of one group (G,) -> advantages (G,). `grpo` follows simple_GRPO: (r - mean) / (std + 1e-4).

    `reinforce_pp` returns the group-centred rewards; the trainer then normalises them over the whole
    batch (reinforce_pp_advantages), which needs every group of the step and so cannot happen here.

    NaN (TRL: a completion for which every reward function returned None) is unscorable: left out of the group's
    mean and std, and its advantage is 0 (TRL's nanmean / nanstd, then nan_to_num)."""
    rewards = rewards.float()
    scored = ~torch.isnan(rewards)
    if not scored.all():
        out = torch.zeros_like(rewards)
        if scored.any():
            out[scored] = group_advantages(rewards[scored], mode, eps) if scored.sum() > 1 or mode == "raw" else 0.0
        return out
    if mode == "raw":
        return rewards.clone()
    centred = rewards - rewards.mean()
    if mode in ("grpo_no_std", "reinforce_pp"):
        return centred
    if mode == "grpo":
        return centred / (rewards.std() + eps)
    raise ValueError(f"unknown advantage mode {mode!r}; use grpo, grpo_no_std, reinforce_pp or raw")


def reinforce_pp_advantages(centred: torch.Tensor, eps: float = 1e-8, all_reduce=None) -> torch.Tensor:
    """REINFORCE++-baseline: group-centred rewards (B,) normalised with the mean and std over the whole batch.

    `all_reduce(t)` sums a float64 tensor over the data-parallel ranks in place (None = this batch is the
    whole batch), so every rank normalises with the statistics of the global step batch."""
    x = centred.double()
    s = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])
    if all_reduce is not None:
        all_reduce(s)
    n = s[2].clamp(min=1)
    mean = s[0] / n
    var = (s[1] / n - mean * mean).clamp(min=0)  # population variance over every completion of the batch
    return ((x - mean) / (var.sqrt() + eps)).to(centred.dtype)


def overlong_penalty(completion_lens: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
                     ) -> torch.Tensor:
    """DAPO soft overlong punishment (eq. 13), added to the reward: 0 up to max_new_tokens - buffer tokens, then
    falling linearly to -penalty at max_new_tokens (completions never exceed it here: generation stops there)."""
    if buffer <= 0 or penalty == 0:
        return torch.zeros(completion_lens.shape, dtype=torch.float32)
    start = max_new_tokens - buffer
    over = (completion_lens.double() - start).clamp(min=0, max=buffer)
    return (-penalty * over / buffer).float()


def has_spread(rewards: torch.Tensor, tol: float = 1e-6) -> bool:
    """A group whose rewards are all equal carries no signal (zero advantage): skip it. NaN (unscorable) rows
    are left out."""
    rewards = rewards[~torch.isnan(rewards)]
    return rewards.numel() > 1 and bool((rewards.max() - rewards.min()) > tol)


def k3_kl(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(d) - d - 1, d = ref - logp (>= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def grpo_loss(logps: torch.Tensor, ref_logps: torch.Tensor | None, old_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, eps_low: float, eps_high: float,
              aggregation: str, max_new_tokens: int, importance_sampling_level: str = "token",
              is_weights: torch.Tensor | None = None, objective: str = "clip",
              sapo_tau: tuple[float, float] = (1.0, 1.05), loss_mask: torch.Tensor | None = None,
              bias_correction_kl: bool = False) -> torch.Tensor:
    """Scalar GRPO loss. logps/ref_logps/old_logps (B, T) over completion tokens, advantages (B,), mask (B, T) bool.

    importance_sampling_level="sequence" (GSPO): pass the sequence epsilons as eps_low/eps_high.
    is_weights (B, T), optional: per-token weights on the policy term (off-policy correction, entropy mask).
    sapo_tau: (positive-advantage, negative-advantage) temperatures of objective sapo.
    loss_mask (B, T) bool, optional: the tokens the policy sampled (False = a tool turn's token). ANDed into mask,
    so a masked token is in no term and no normaliser: policy term, KL, GSPO's sequence ratio, every aggregation.
    is_weights are taken as given (trainer/objective/update.py computes them over the same ANDed mask).
    bias_correction_kl (TRL's use_bias_correction_kl): the KL term times the ratio r (token, or GSPO's sequence
    ratio), gradient included: r * k3, whose gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2); the
    is_weights stay on the policy term only, as TRL's."""
    if loss_mask is not None:
        mask = mask.bool() & loss_mask.bool()
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; use one of {AGGREGATIONS}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; use one of {IS_LEVELS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use one of {OBJECTIVES}")
    A = advantages.to(logps.dtype)[:, None]
    ratio = torch.exp(_log_ratio(logps, old_logps, mask, importance_sampling_level))
    if objective == "cispo":  # the weight carries no gradient: the gradient is that of logp, never zeroed
        per_token = -torch.clamp(ratio, max=eps_high).detach() * A * logps
    elif objective == "sapo":
        pos, neg = (torch.tensor(t, dtype=logps.dtype, device=logps.device) for t in sapo_tau)
        tau = torch.where(A > 0, pos, neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    elif old_logps is not None:
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
    else:
        per_token = -ratio * A  # value 1, gradient = grad(logp) * A (mean logp for sequence)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    if beta != 0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        kl = k3_kl(ref_logps, logps)
        per_token = per_token + beta * (kl * ratio if bias_correction_kl else kl)
    m = mask.to(per_token.dtype)
    if aggregation == "seq_mean":  # simple_GRPO: mean over each completion's tokens, then over completions
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if aggregation == "token_mean":  # every token of the batch weighs the same (DAPO)
        return (per_token * m).sum() / m.sum().clamp(min=1)
    if aggregation == "luspo":  # each completion weighs its length (LUSPO)
        return (per_token * m).sum(1).mean()
    # dr_grpo: token sum over a constant length, so long completions are not down-weighted
    return (per_token * m).sum() / (per_token.shape[0] * max_new_tokens)


def entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, gather=None) -> torch.Tensor:
    """TRL's top_entropy_quantile (get_high_entropy_mask): 1 on the completion tokens whose entropy is at or above
    the (1 - quantile) quantile of the completion-token entropies of this micro-batch on EVERY rank, 0 elsewhere
    (the 80/20 'forking tokens' rule). `gather(values)` concatenates every rank's values (trainer/dist/comm.py
    all_gather_values; None = one rank). quantile 0 keeps only the highest-entropy tokens (TRL accepts it)."""
    if quantile >= 1.0:
        return mask.to(entropy.dtype)
    vals = entropy.detach()[mask.bool()].float()
    if gather is not None:
        vals = gather(vals)
    if vals.numel() == 0:
        return torch.zeros_like(entropy)
    cut = torch.quantile(vals, 1.0 - quantile)
    return ((entropy.detach() >= cut) & mask.bool()).to(entropy.dtype)


def _log_ratio(logps: torch.Tensor, old_logps: torch.Tensor | None, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(B, T) log importance ratios: per token, or GSPO's masked token mean broadcast over the sequence.
    Without old_logps the REINFORCE form: log-ratio 0 whose gradient is that of logp (or of its mean)."""
    base = logps.detach() if old_logps is None else old_logps
    d = logps - base
    if level == "token":
        return d
    m = mask.to(d.dtype)
    seq = (d * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return seq.expand_as(d)


@torch.no_grad()
def loss_stats(logps: torch.Tensor, ref_logps: torch.Tensor | None, old_logps: torch.Tensor | None,
               advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float,
               importance_sampling_level: str = "token", objective: str = "clip") -> dict:
    """Diagnostics over masked tokens: mean k3 KL to the reference and the fraction of clipped ratios against
    the π_old given (old_logps; with sequence-level ratios a clipped completion counts all its tokens).
    cispo: the share of positive-advantage tokens whose weight hit the cap (TRL's cispo_clip_ratio); sapo: 0."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    out = {"kl": float((k3_kl(ref_logps, logps) * m).sum() / n) if ref_logps is not None else 0.0}
    if old_logps is not None:
        ratio = torch.exp(_log_ratio(logps, old_logps, m, importance_sampling_level))
        A = advantages[:, None].expand_as(ratio)
        # A token is clipped when the clipped branch is the active (smaller) one and has no gradient.
        clipped = ((ratio > 1 + eps_high) & (A > 0)) | ((ratio < 1 - eps_low) & (A < 0))
        if objective == "cispo":
            clipped = (ratio > eps_high) & (A > 0)
        elif objective == "sapo":
            clipped = torch.zeros_like(clipped)
        out["clip_frac"] = float((clipped & m).sum() / n)
        out["ratio_mean"] = float((ratio * m).sum() / n)
    else:
        out["clip_frac"] = 0.0
        out["ratio_mean"] = 1.0
    return out


@torch.no_grad()
def mismatch_stats(logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mean and max |trainer logp - engine logp| over the trained (masked) tokens."""
    d = (logps.detach() - engine_logps).abs().masked_fill(~mask.bool(), 0.0)
    n = mask.sum().clamp(min=1)
    return {"logp_mismatch_mean": float(d.sum() / n), "logp_mismatch_max": float(d.max()) if d.numel() else 0.0}
