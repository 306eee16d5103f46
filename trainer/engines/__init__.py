"""Generation engines: one face, two rooms (HF `generate` in hf.py, vLLM in vllm.py).

    engine = make_engine(cfg, model_path)            # cfg.gen_backend in {"hf", "vllm"}
    samples = engine.generate(prompt_ids, n, max_new_tokens=64, greedy=False)
    engine.load_weights(named_tensors)               # HF parameter names, full tensors, any subset
                                                     # (tied lm_head.weight: optional, filled from the embedding)

Both sample exactly the configured distribution (temperature, top_p, top_k, and TRL's min_p,
repetition_penalty and generation_kwargs where the config sets them: cfg.sampling_extras(), rollouts only): the
checkpoint's generation_config (repetition_penalty, its own top_k/top_p/temperature, ...) is ignored,
and what was ignored is logged once. The loss assumes rollouts come from the policy it differentiates.
"""
from __future__ import annotations

from trainer.engines.base import (
    NEUTRAL,
    OURS,
    EngineDied,
    GenEngine,
    Sample,
    cut_at_eos,
    ignored_generation_settings,
)

__all__ = ["BACKENDS", "NEUTRAL", "OURS", "EngineDied", "GenEngine", "Sample", "cut_at_eos",
           "ignored_generation_settings", "make_engine"]

BACKENDS = ("hf", "vllm")


def make_engine(cfg, model_path: str, *, model=None, tokenizer=None) -> GenEngine:
    """The engine `cfg.gen_backend` names. HF can wrap a live model (trainer ranks); vLLM loads its own.
    Generation settings still `auto` (a cfg built in code) are resolved for the device by each engine's from_config,
    as at a worker's start (common/settings/gen_defaults.py); so are bf16, vllm_dtype and gen_backend auto
    (common/placement/gen_choice.py)."""
    if "auto" in (cfg.gen_backend, cfg.vllm_dtype, cfg.bf16):
        from common.placement.gen_choice import resolve_machine
        from common.settings.gen_defaults import on_cuda
        cfg = resolve_machine(cfg, cuda=on_cuda(cfg.device))[0]
    if cfg.gen_backend == "hf":
        from trainer.engines.hf import HFEngine
        return HFEngine.from_config(cfg, model_path, model=model, tokenizer=tokenizer)
    if cfg.gen_backend == "vllm":
        from trainer.engines.vllm import VLLMEngine
        return VLLMEngine.from_config(cfg, model_path, tokenizer=tokenizer)
    raise ValueError(f"unknown gen_backend {cfg.gen_backend!r}; use one of {BACKENDS}")
