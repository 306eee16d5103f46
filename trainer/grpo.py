"""The GRPO objective: group advantages and one pure loss function.

    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3(ref || policy)

with r = exp(logp - gen_logp) per token (or the REINFORCE form exp(logp - logp.detach()) when
there are no generation-time logprobs), aggregated over completion tokens only.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean", "token_mean", "dr_grpo")


def group_advantages(rewards: torch.Tensor, mode: str = "grpo", eps: float = 1e-4) -> torch.Tensor:
    """Rewards of one group (G,) -> advantages (G,). `grpo` follows simple_GRPO: (r - mean) / (std + 1e-4)."""
    rewards = rewards.float()
    if mode == "raw":
        return rewards.clone()
    centred = rewards - rewards.mean()
    if mode == "grpo_no_std":
        return centred
    if mode == "grpo":
        return centred / (rewards.std() + eps)
    raise ValueError(f"unknown advantage mode {mode!r}; use grpo, grpo_no_std or raw")


def has_spread(rewards: torch.Tensor, tol: float = 1e-6) -> bool:
    """A group whose rewards are all equal carries no signal (zero advantage): skip it."""
    return bool((rewards.max() - rewards.min()) > tol)


def k3_kl(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(d) - d - 1, d = ref - logp (>= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def grpo_loss(logps: torch.Tensor, ref_logps: torch.Tensor | None, gen_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, eps_low: float, eps_high: float,
              aggregation: str, max_new_tokens: int, is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar GRPO loss. logps/ref_logps/gen_logps (B, T) over completion tokens, advantages (B,), mask (B, T) bool.

    is_weights (B, T), optional: per-token importance weights on the policy term (truncated IS, see tis_weights)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; use one of {AGGREGATIONS}")
    A = advantages.to(logps.dtype)[:, None]
    if gen_logps is not None:
        ratio = torch.exp(logps - gen_logps)
        per_token = torch.min(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
    else:
        per_token = torch.exp(logps - logps.detach()) * A  # value 1, gradient = grad(logp) * A
    per_token = -per_token
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    if beta != 0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        per_token = per_token + beta * k3_kl(ref_logps, logps)
    m = mask.to(per_token.dtype)
    if aggregation == "seq_mean":  # simple_GRPO: mean over each completion's tokens, then over completions
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if aggregation == "token_mean":  # every token of the batch weighs the same (DAPO)
        return (per_token * m).sum() / m.sum().clamp(min=1)
    # dr_grpo: token sum over a constant length, so long completions are not down-weighted
    return (per_token * m).sum() / (per_token.shape[0] * max_new_tokens)


@torch.no_grad()
def loss_stats(logps: torch.Tensor, ref_logps: torch.Tensor | None, gen_logps: torch.Tensor | None,
               advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float) -> dict:
    """Diagnostics over masked tokens: mean k3 KL to the reference and the fraction of clipped ratios."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    out = {"kl": float((k3_kl(ref_logps, logps) * m).sum() / n) if ref_logps is not None else 0.0}
    if gen_logps is not None:
        ratio = torch.exp(logps - gen_logps)
        A = advantages[:, None].expand_as(ratio)
        # A token is clipped when the clipped branch is the active (smaller) one and has no gradient.
        clipped = ((ratio > 1 + eps_high) & (A > 0)) | ((ratio < 1 - eps_low) & (A < 0))
        out["clip_frac"] = float((clipped & m).sum() / n)
        out["ratio_mean"] = float((ratio * m).sum() / n)
    else:
        out["clip_frac"] = 0.0
        out["ratio_mean"] = 1.0
    return out


def tis_weights(old_logps: torch.Tensor, engine_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (train/inference mismatch correction, as in verl/Yao et al. 2025):
    min(exp(trainer old logp - engine logp), cap) per token, no gradient. Tokens the engine sampled more
    often than the trainer's policy would are down-weighted; the cap bounds the variance."""
    return torch.exp(old_logps.detach() - engine_logps).clamp(max=cap)


@torch.no_grad()
def mismatch_stats(logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mean and max |trainer logp - engine logp| over the trained (masked) tokens."""
    d = (logps.detach() - engine_logps).abs().masked_fill(~mask.bool(), 0.0)
    n = mask.sum().clamp(min=1)
    return {"logp_mismatch_mean": float(d.sum() / n), "logp_mismatch_max": float(d.max()) if d.numel() else 0.0}
