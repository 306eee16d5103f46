"""DeepSpeed for the policy: distributed init, the ds_config this GRPOConfig implies, the LR schedule,
and the engine wrapping the model (resumed from output_dir/ds when asked)."""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from common.compile_off import compile_off
from common.config import GRPOConfig
from common.modeling import load_model
from trainer.dist import nodes
from trainer.memory_defaults import resolve_memory_defaults
from trainer.objective.microbatch import micro_batches_per_step, micro_rows

log = logging.getLogger("trainer")


def ds_config_for(cfg: GRPOConfig, on_gpu: bool) -> dict:
    """ds_config.json with the fields this config owns filled in (one source of truth for each knob)."""
    ds = json.loads(Path(cfg.ds_config).read_text())
    ds.pop("train_batch_size", None)  # derived: micro x accumulation x world
    # Rows per forward/backward; DeepSpeed steps the optimizer after grad_accum steps' micro-batches
    # (trainer/objective/microbatch.py: one optimizer update per step with grad_accum 1).
    ds["train_micro_batch_size_per_gpu"] = micro_rows(cfg)
    ds["gradient_accumulation_steps"] = cfg.grad_accum * micro_batches_per_step(cfg)
    ds["gradient_clipping"] = cfg.grad_clip
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt.setdefault("params", {}).update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if not on_gpu:
        opt["params"]["torch_adam"] = True  # no fused-op compilation on CPU
    if cfg.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = cfg.zero_stage
    if nodes.num_nodes() > 1:  # no shared filesystem: each host's local rank 0 writes its model states
        ds.setdefault("checkpoint", {})["use_node_local_storage"] = True
    bf16 = ds.setdefault("bf16", {})
    if cfg.bf16 == "auto":  # a cfg built in code (the ranks resolved theirs at start: resolve_at_start)
        from common.settings.precision import resolve_precision
        cfg = resolve_precision(cfg, cuda=on_gpu)[0]
    if cfg.bf16 is not None:
        bf16["enabled"] = cfg.bf16
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = bool(on_gpu and torch.cuda.is_bf16_supported())
    return ds


def lr_lambda(cfg: GRPOConfig):
    """LR factor of optimizer update `step` (0-based; DeepSpeed steps the scheduler once per update, at the
    accumulation boundary). The horizon is all_steps: one step = one update (trainer/objective/update.py)."""
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        total = max(1, cfg.all_steps - cfg.warmup_steps)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / total)))
        if cfg.lr_schedule == "linear":  # transformers' get_linear_schedule_with_warmup: 0 at all_steps
            return max(0.0, (cfg.all_steps - step) / total)
        return 1.0
    return f


def skip_shm_op(deepspeed) -> None:
    """Before deepspeed.init_distributed on CPU: gloo does without DeepSpeed's shared-memory op, whose JIT gcc build
    costs ~40 s (minutes on a fresh virtual environment's 2 cores, every rank waiting on its lock)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def muon_left_uncompiled(ds_cfg: dict):
    """Around deepspeed.initialize: DeepSpeed's ZeRO code imports its Muon optimizer module (to list Muon as
    supported, and for isinstance checks), and that import torch.compile's Muon's kernels: inductor's import, ~1 CPU-s
    and ~1 s at every rank's start, for an optimizer the run does not use. Left uncompiled (common/compile_off.py)
    unless ds_config's optimizer is Muon."""
    return nullcontext() if "muon" in str(ds_cfg.get("optimizer", {}).get("type", "")).lower() else compile_off()


def initialize(deepspeed, config: dict, **kw):
    """deepspeed.initialize(config=config, **kw), Muon's kernels left uncompiled as above: the one way every
    caller (the trainer, tests, benches) builds an engine."""
    with muon_left_uncompiled(config):
        return deepspeed.initialize(config=config, **kw)


def init_deepspeed(cfg: GRPOConfig):
    import deepspeed

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_shm_op(deepspeed)
    # dist_timeout: a rank whose peer died leaves a collective after this, not torch's 30 min
    deepspeed.init_distributed(dist_backend=None if on_gpu else "gloo",
                               timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    return deepspeed, rank, world, on_gpu


def prepare_policy(model, cfg: GRPOConfig):
    """The loaded model made ready to train: gradient checkpointing, LoRA adapters, train mode.

    Train mode matters beyond dropout: transformers recomputes activations only in a module that is
    training, and from_pretrained returns the model in eval mode, so without .train() gradient
    checkpointing silently keeps every activation (a 0.5B model then runs out of memory on 24 GiB).
    Generation switches to eval mode for its own calls (trainer/engines/hf.py)."""
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_r > 0:  # only the adapters get gradients and optimizer state (trainer/lora/adapters.py)
        from trainer.lora.adapters import wrap_lora
        model = wrap_lora(model, cfg)
    model.train()
    return model


def build_engine(cfg: GRPOConfig, deepspeed, model_path: str, on_gpu: bool):
    """The policy under DeepSpeed. Returns (engine, zero_stage, start_step); start_step > 0 after a resume."""
    ds_cfg = ds_config_for(cfg, on_gpu)
    if on_gpu and (cfg.micro_batch_size is None or cfg.gradient_checkpointing is None):
        resolve_memory_defaults(cfg, ds_cfg, model_path, on_gpu)  # unset on GPUs: picked to fit
        ds_cfg = ds_config_for(cfg, on_gpu)
    # bf16 under DeepSpeed (auto on GPUs, or --bf16 true on CPU): bf16 weights, fp32 master
    # copy of each rank's partition. Loaded in bf16 straight away: no transient fp32 copy of the whole model.
    bf16 = bool(ds_cfg.get("bf16", {}).get("enabled"))
    model = prepare_policy(load_model(model_path, device="cpu", dtype="bfloat16" if bf16 else "float32",
                                      trainable=True, options=cfg.load_options()), cfg)
    zero_stage = int(ds_cfg.get("zero_optimization", {}).get("stage", 0))
    engine, _, _, _ = initialize(deepspeed, ds_cfg, model=model,
                                 model_parameters=[p for p in model.parameters() if p.requires_grad],
                                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)))
    start_step = 0
    if cfg.resume:
        ds_dir = Path(cfg.output_dir) / "ds"
        tag = nodes.agreed_tag(ds_dir)  # every host resumes the same step, or none does
        path, client_state = engine.load_checkpoint(str(ds_dir), tag=tag) if tag else (None, None)
        if path is None:
            log.info("--resume: no DeepSpeed checkpoint in %s, starting from step 0", ds_dir)
        else:
            start_step = int(client_state["step"])
            log.info("resumed from %s at step %d", path, start_step)
    return engine, zero_stage, start_step
