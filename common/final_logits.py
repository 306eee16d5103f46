"""What a model's own forward does to the LM head's output before it returns logits, for architectures that
do more than `lm_head(h)`: common/logprobs.py calls the body and the head directly (to chunk the vocabulary
projection), so it must apply the same step or its logprobs are of another distribution.

    Gemma-2/3   final_logit_softcapping c:  logits = c * tanh(logits / c)
    Cohere      logit_scale s:              logits = logits * s
    Granite     logits_scaling s:           logits = logits / s
"""
from __future__ import annotations

from collections.abc import Callable

import torch

LogitFn = Callable[[torch.Tensor], torch.Tensor]


def final_logit_fn(model: torch.nn.Module) -> LogitFn | None:
    """The model's final-logit processing as a function of the head's output, or None when there is none."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere (a multiplier)
    divide = getattr(config, "logits_scaling", None)  # Granite (a divisor)
    steps: list[LogitFn] = []
    if cap:
        steps.append(lambda x: torch.tanh(x / cap) * cap)
    if scale is not None and scale != 1:
        steps.append(lambda x: x * scale)
    if divide is not None and divide != 1:
        steps.append(lambda x: x / divide)
    if not steps:
        return None

    def apply(x: torch.Tensor) -> torch.Tensor:
        for f in steps:
            x = f(x)
        return x
    return apply
