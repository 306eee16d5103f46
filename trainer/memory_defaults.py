"""micro_batch_size / gradient_checkpointing left unset (null) on GPUs, where the launcher did not pick them
(a bare `deepspeed trainer/main.py`, `launch.sh trainer-host`, or a launcher that could not read the GPUs'
memory): the values the memory estimate (common/placement/memory_plan.py) says fit each rank's free GPU memory now, the
smallest over the ranks so that every rank runs the same micro-batches. Nothing fits: the run stops here, with
the numbers. On CPU the fields stay unset: the whole batch at once, no checkpointing (as before)."""
from __future__ import annotations

import logging

import torch

from common.config import GRPOConfig
from common.placement.memory_plan import FIT_SHARE, ModelShape, describe_parts, gib, pick, rank_parts
from common.placement.memory_report import train_settings
from trainer.dist import comm

log = logging.getLogger("trainer")


def resolve_memory_defaults(cfg: GRPOConfig, ds_cfg: dict, model_path: str, on_gpu: bool) -> None:
    if not on_gpu or (cfg.micro_batch_size is not None and cfg.gradient_checkpointing is not None):
        return
    free = comm.all_reduce_int(torch.cuda.mem_get_info()[0], "min")  # CUDA context already in use: not counted
    shape = ModelShape.from_config(model_path)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rows = cfg.train_batch_groups * cfg.num_pre_Q
    need = lambda m, gc: rank_parts(shape, train_settings(cfg, ds_cfg, shape, world, cfg.num_gen_workers,  # noqa
                                                          m, gc))
    chosen = pick(lambda m, gc: sum(need(m, gc).values()) <= FIT_SHARE * free, rows, cfg.micro_batch_size,
                  cfg.gradient_checkpointing)
    if chosen is None:
        least = need(1, True)
        raise RuntimeError(f"memory: each rank needs {gib(sum(least.values()))} GiB even at micro_batch_size 1 with "
                           f"gradient checkpointing ({describe_parts(least)}), the GPUs have {gib(free)} GiB free "
                           f"(the least over the ranks): use more ranks, zero_stage 3, LoRA (lora_r), a shorter "
                           f"max_prompt_length/max_new_tokens or larger GPUs (docs/gpus.md)")
    m, gc = chosen
    log.info("memory: micro_batch_size %d, gradient_checkpointing %s picked to fit %s GiB free per GPU (%s; "
             "unset in the config; docs/gpus.md)", m, str(gc).lower(), gib(free), describe_parts(need(m, gc)))
    cfg.micro_batch_size, cfg.gradient_checkpointing = m, gc
