"""Sampling inside HF `generate` by the Gumbel-max trick: argmax(scores + G), G iid Gumbel(0, 1), is an exact draw
from softmax(scores), so generate runs its greedy loop (argmax) over scores this processor has warped and noised.

Why: transformers samples with torch.multinomial, which on CPU draws exponential noise over the whole vocabulary
(`exponential_`): 1.14 ms a step for 64 rows of the demo's 774-token vocab at one thread, against 0.33 ms for
uniform noise and two logs (the same draw): 11-13 % of the demo worker's samples were that one call (issue 62,
docs/benchmarks.md). The warpers are transformers' own classes, in the order `generate` applies them for
do_sample; the raw logits generate returns (`output_logits`, the worker's logprobs) are before any processor, as
with do_sample. Only for the plain sampler (temperature, top_k, top_p): anything else a run sets (min_p, a
repetition_penalty other than 1, TRL's generation_kwargs) keeps generate's own sampling, the same distribution.

    procs = gumbel_sampler(temperature=1.0, top_k=0, top_p=1.0)   # a LogitsProcessorList
    model.generate(..., do_sample=False, logits_processor=procs)  # a sample, not the argmax
"""
from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class GumbelSample(LogitsProcessor):
    """The sampling warpers, then Gumbel noise: generate's argmax of the result is a sample of the warped softmax."""

    def __init__(self, warpers: list[LogitsProcessor]):
        self.warpers = warpers

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        u = torch.rand_like(scores, dtype=torch.float32)  # [0, 1): u = 0 is noise -inf, never the argmax
        return scores - u.log_().neg_().log_()  # scores + Gumbel(0, 1) = scores - log(-log u); -inf stays -inf


def plain_sampler(extra: dict) -> bool:
    """Whether the run's sampling is only temperature / top_k / top_p (extra: HFEngine's sampling_extras)."""
    return all(k == "repetition_penalty" and float(v) == 1.0 for k, v in extra.items())


def gumbel_sampler(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' warpers for these settings, as `_get_logits_processor` builds them for do_sample (one
    sequence per row: min_tokens_to_keep 1), inside one GumbelSample."""
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return LogitsProcessorList([GumbelSample(warpers)])
