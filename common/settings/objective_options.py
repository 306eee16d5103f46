"""GRPOConfig's fields for the objective beyond the clip and the KL (issue 24): pi_old, the off-policy correction of
an engine's samples, and TRL's loss family (loss_type and its knobs). A mixin, as common/settings/tool_options.py's
ToolOptions, so that common/config.py stays small; the "objective" section of --help lists them with the rest
(common/settings/sections.py), and common/settings/checks.py checks them.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.choices import ISMode, OldLogps
from common.settings.knobs import knob


@dataclass
class ObjectiveOptions:
    old_logps: OldLogps = knob("trainer", "π_old of the clipped ratio. trainer: the trainer's own first-pass "
                                          "logprobs of the batch (TRL, GSPO paper: ratio 1 on the first pass, later "
                                          "mu passes clip against it), the engine's logprobs used only for the "
                                          "importance-sampling correction below. engine: the former objective, ratio "
                                          "against the sampling engine's logprobs (stale, bf16), no correction; "
                                          "needs compute_gen_logps.")
    vllm_importance_sampling_correction: bool = knob(True, "TRL name. With old_logps trainer: weight each token's "
                                                           "policy term by rho = exp(π_old logp - engine logp), "
                                                           "correcting engine mismatch and staleness (any engine, "
                                                           "HF or vLLM), where the batch has engine logprobs.")
    vllm_importance_sampling_mode: ISMode = knob("sequence_mask", "TRL name: token_truncate, token_mask, "
                                                                  "sequence_truncate or sequence_mask. token_*: rho "
                                                                  "per token; sequence_*: exp(sum of the "
                                                                  "completion's log ratios) on all its tokens. "
                                                                  "*_truncate clamps rho to [clip_min, clip_max]; "
                                                                  "*_mask zeroes it outside.")
    vllm_importance_sampling_clip_max: float | None = knob(3.0, "TRL name: upper bound of rho (TRL's "
                                                                "vllm_importance_sampling_cap is an alias).")
    vllm_importance_sampling_clip_min: float | None = knob(None, "TRL name: lower bound of rho (null = none).")
    loss_type: str | None = knob(None, "TRL's loss_type (objective + aggregation): grpo (clip, seq_mean), bnpo "
                                       "(clip, token_mean), dr_grpo, dapo (clip, global token mean), cispo "
                                       "(MiniMax-M1: -sg(min(r, eps_high)) A logp, dapo aggregation; eps_high is "
                                       "the absolute cap, e.g. 5), sapo (soft gate, seq_mean), luspo (GSPO with "
                                       "length scaling: use importance_sampling_level sequence). null = the clipped "
                                       "objective with `aggregation`. Sets aggregation; a different explicit "
                                       "aggregation is an error.")
    sapo_temperature_pos: float = knob(1.0, "TRL name: SAPO gate temperature for positive advantages.")
    sapo_temperature_neg: float = knob(1.05, "TRL name: SAPO gate temperature for negative advantages.")
    top_entropy_quantile: float = knob(1.0, "TRL name: train the policy term only on the completion tokens in this "
                                            "top quantile of entropy (as TRL: cut per micro-batch over every rank; "
                                            "0.2 = the 80/20 rule of arXiv:2506.01939). 1 = all tokens, 0 = the "
                                            "highest only.")
    off_policy_mask_threshold: float | None = knob(None, "TRL name (DeepSeek-V3.2 off-policy sequence masking): "
                                                         "drop completions with negative advantage whose mean "
                                                         "per-token KL(engine || policy) exceeds this. null = off.")
