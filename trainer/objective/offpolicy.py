"""Off-policy corrections: the sampling engine is not the policy the loss clips against.

π_old (what the PPO/GSPO ratio is taken against) is the trainer's own first-pass logprobs of the batch
(`old_logps: trainer`, as TRL and the GSPO paper): the ratio is exactly 1 on the first pass, and with
mu > 1 the later passes clip against it. The batch was sampled by an engine (vLLM/HF worker, bf16, up
to `max_staleness` versions behind), so each token's policy term is weighted by the importance ratio

    rho = exp(old logp - engine logp)          (TRL's vllm_importance_sampling_correction)

per token, or per sequence as exp(sum over the completion's tokens), and then either truncated to
[clip_min, clip_max] or masked (set to 0) outside that range. `off_policy_mask` is DeepSeek-V3.2's
off-policy sequence mask (TRL's off_policy_mask_threshold). None of these carry a gradient.
"""
from __future__ import annotations

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def importance_weights(old_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_max: float | None, clip_min: float | None = None) -> tuple[torch.Tensor, dict]:
    """(B, T) weights on the policy term and their diagnostics over the trained tokens.

    Returns weights broadcast to (B, T) and {"is_weight_mean": mean weight over masked tokens (after
    truncation/masking), "is_masked_share": share of tokens (token_*) or of sequences (sequence_*) whose
    ratio fell outside [clip_min, clip_max] (masked by *_mask, truncated by *_truncate)}."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}; use one of {IS_MODES}")
    m = mask.to(old_logps.dtype)
    diff = (old_logps - engine_logps) * m  # padding contributes nothing
    sequence = mode.startswith("sequence")
    log_rho = diff.sum(1, keepdim=True) if sequence else diff
    rho = torch.exp(log_rho)
    lo = torch.zeros_like(rho, dtype=torch.bool) if clip_min is None else rho < clip_min
    hi = torch.zeros_like(rho, dtype=torch.bool) if clip_max is None else rho > clip_max
    out_of_band = lo | hi
    if mode.endswith("truncate"):
        w = rho if clip_min is None and clip_max is None else rho.clamp(min=clip_min, max=clip_max)
    else:
        w = rho.masked_fill(out_of_band, 0.0)
    w = w.expand_as(old_logps)
    n_tok = m.sum().clamp(min=1)
    if sequence:
        rows = (m.sum(1) > 0)
        share = float((out_of_band.squeeze(1) & rows).sum() / rows.sum().clamp(min=1))
    else:
        share = float((out_of_band.to(m.dtype) * m).sum() / n_tok)
    return w, {"is_weight_mean": float((w * m).sum() / n_tok), "is_masked_share": share}


@torch.no_grad()
def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, float]:
    """DeepSeek-V3.2 off-policy sequence masking (TRL off_policy_mask_threshold): drop a completion whose
    advantage is negative and whose mean per-token KL(sampling || current), estimated as mean(sampling logp -
    logp), exceeds `threshold`. Returns the (B, 1) keep mask and the share of completions dropped."""
    m = mask.to(logps.dtype)
    seq_kl = ((sampling_logps - logps.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    keep = (advantages[:, None] >= 0) | (seq_kl <= threshold)
    rows = m.sum(1) > 0
    dropped = float(((~keep.squeeze(1)) & rows).sum() / rows.sum().clamp(min=1))
    return keep.to(logps.dtype), dropped


@torch.no_grad()
def in_band_share(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, eps_low: float,
                  eps_high: float) -> float:
    """GSPO diagnostic: the share of completions whose sequence ratio exp(mean(logp - old)) lies inside
    [1 - eps_low, 1 + eps_high], i.e. that get a gradient whatever the sign of their advantage."""
    m = mask.to(logps.dtype)
    rows = m.sum(1) > 0
    s = torch.exp(((logps - old_logps) * m).sum(1) / m.sum(1).clamp(min=1))
    inside = (s >= 1 - eps_low) & (s <= 1 + eps_high) & rows
    return float(inside.sum() / rows.sum().clamp(min=1))
