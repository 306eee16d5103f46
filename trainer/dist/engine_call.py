"""Run a training forward through DeepSpeed's engine, whatever the forward computes.

The trainer does not call the causal LM's own forward (logits over the whole vocabulary for every position): it
runs the decoder body and the LM head a chunk at a time (common/logprobs.py). But DeepSpeedEngine.forward does
bookkeeping that gradient accumulation depends on, and calling the modules directly skipped it:
- `clear_backward_seen_flag()`: under ZeRO-3 this is the only place the micro-step counter advances, and ZeRO-3
  copies (rather than adds) a gradient into its partition while that counter is 0, so every micro-batch
  overwrote the one before and an update came from the last micro-batch alone (issue 30: 48.6 % of the weights
  moved differently from ZeRO-0 after one AdamW update); ZeRO-1/2 clear their accumulation buffers there;
- the backward prologue, hooked onto the forward's outputs (accumulation-boundary flag, ZeRO's
  enter-backward state);
- ZeRO-3's per-step reset of its parameter prefetcher, a pre-forward hook on the top module.

`engine_forward(engine, fn)` runs `fn()` as the top module's forward for one `engine()` call, so all of it happens
exactly as DeepSpeed does it, at every stage and for any engine (built by trainer/deepspeed_policy.py or by a test).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def engine_forward(engine, fn: Callable[[], Any]) -> Any:
    """`engine()` with `fn` standing in for the module's forward for this one call; returns fn's outputs."""
    module = engine.module
    own = module.__dict__.get("forward")  # an instance-level forward someone else installed (kept)
    module.forward = lambda *args, **kwargs: fn()  # an instance attribute shadows the class's forward
    try:
        return engine()
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
