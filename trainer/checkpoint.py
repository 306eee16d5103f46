"""Checkpoints: HF directories (from_pretrained-loadable) next to DeepSpeed's resumable state."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("trainer")


def save_hf(engine, tokenizer, out: Path, rank: int, zero_stage: int, final: bool = False) -> None:
    """HF directory loadable with from_pretrained. Under ZeRO-3 the shards are gathered first (all ranks).
    A LoRA policy saves its adapter (PeftModel-loadable), and at the end (`final`) the merged model."""
    import deepspeed

    from trainer.lora import is_lora, save_adapter, save_merged

    model = engine.module
    if is_lora(model):
        return (save_merged if final else save_adapter)(engine, tokenizer, out, rank, zero_stage)
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if rank == 0:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    elif rank == 0:
        state = None
    if rank == 0:
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        log.info("saved HF checkpoint %s", out)
    torch.distributed.barrier()
