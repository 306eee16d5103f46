"""Checkpoints: HF directories (from_pretrained-loadable) next to DeepSpeed's resumable state.

HF checkpoints are written in the model's own dtype (a bf16 checkpoint stays bf16 although ranks
train in float32), and only the newest `save_total_limit` of each kind are kept: DeepSpeed tags
hold the optimizer state (several times the model) and pile up otherwise.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from trainer.dist import nodes
from trainer.dist.gather import GATHER_BUCKET_BYTES, state_copies

log = logging.getLogger("trainer")


def source_dtype(model_path: str, options: dict | None = None) -> torch.dtype | None:
    """The dtype the checkpoint's config.json declares (None when it declares none); `options`: the model's
    loading options (trust_remote_code, revision)."""
    from common.modeling import load_model_config

    dt = getattr(load_model_config(model_path, options), "dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else None


def cast_state(state: dict, dtype: torch.dtype | None) -> dict:
    """Floating tensors to `dtype`; tensors that share memory (tied embeddings) stay shared, so
    save_pretrained still writes them once."""
    if dtype is None:
        return state
    done: dict = {}
    out = {}
    for k, v in state.items():
        if not v.is_floating_point() or v.dtype == dtype:
            out[k] = v
            continue
        key = (v.data_ptr(), tuple(v.shape))
        if key not in done:
            done[key] = v.detach().to(dtype)
        out[k] = done[key]
    return out


def save_hf(engine, tokenizer, out: Path, rank: int, zero_stage: int, dtype: torch.dtype | None = None,
            final: bool = False, budget: int = GATHER_BUCKET_BYTES) -> None:
    """HF directory loadable with from_pretrained, in `dtype` (the source checkpoint's; None = as trained).
    Under ZeRO-3 the shards are gathered `budget` bytes at a time (all ranks; trainer/dist/gather.py) into rank 0's
    CPU copy. A LoRA policy saves its adapter (PeftModel-loadable), and at the end (`final`) the merged model.
    Written as OUT.partial and renamed once complete (every rank past the save): an interrupted save never leaves
    a directory that looks complete (common/run_record.py removes the .partial)."""
    tmp = out.with_name(out.name + ".partial")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _save_hf(engine, tokenizer, tmp, rank, zero_stage, dtype, final, budget)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    torch.distributed.barrier()


def _save_hf(engine, tokenizer, out: Path, rank: int, zero_stage: int, dtype: torch.dtype | None,
             final: bool, budget: int) -> None:
    from trainer.lora.adapters import is_lora, save_adapter, save_merged

    model = engine.module
    if is_lora(model):
        return (save_merged if final else save_adapter)(engine, tokenizer, out, rank, zero_stage, budget)
    state = None
    if zero_stage == 3:
        state = state_copies(model, zero_stage, rank, dtype, budget)
    elif rank == 0 and dtype is not None:
        state = model.state_dict()
    if rank == 0:
        state = cast_state(state, dtype) if state is not None else None
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        if dtype is not None:  # save_pretrained writes the live parameters' dtype: say what the files hold
            cfg_file = out / "config.json"
            conf = json.loads(cfg_file.read_text())
            conf["dtype"] = str(dtype).replace("torch.", "")
            cfg_file.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(out)
        log.info("saved HF checkpoint %s (%s)", out.with_suffix(""), str(dtype or model.dtype).replace("torch.", ""))
    torch.distributed.barrier()


def _numbered(paths, pattern: str) -> list[tuple[int, Path]]:
    out = []
    for p in paths:
        m = re.fullmatch(pattern, p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def prune_checkpoints(out: Path, limit: int) -> list[Path]:
    """Delete all but the newest `limit` HF step_N directories and DeepSpeed stepN tags (rank 0, after
    every rank has finished writing). The tag DeepSpeed's `latest` names is always kept. Returns what went."""
    if limit <= 0:
        return []
    gone = []
    latest_file = out / "ds" / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    for pattern, where in ((r"step_(\d+)", out), (r"step(\d+)", out / "ds")):
        found = _numbered(where.iterdir(), pattern) if where.is_dir() else []
        for _, p in found[:-limit]:
            if p.name == latest:
                continue
            shutil.rmtree(p)
            gone.append(p)
    if gone:
        log.info("save_total_limit=%d: removed %s", limit, ", ".join(str(p.relative_to(out)) for p in gone))
    return gone


def save_step(engine, tokenizer, out: Path, step: int, cfg, rank: int, zero_stage: int,
              dtype: torch.dtype | None) -> None:
    """The DeepSpeed tag (for --resume) and, except at the last step (`final` follows, the same weights),
    an HF step_N directory; then retention."""
    engine.save_checkpoint(str(out / "ds"), tag=f"step{step}", client_state={"step": step})
    nodes.write_latest(out / "ds", f"step{step}")  # the other hosts' own `latest` (DeepSpeed: rank 0's only)
    from trainer.lora.adapters import is_lora

    # a LoRA run's `final` is the merged model, so its last adapter is no duplicate: keep it as step_N
    if step % cfg.save_steps == 0 and (step != cfg.all_steps or is_lora(engine.module)):
        save_hf(engine, tokenizer, out / f"step_{step}", rank, zero_stage, dtype)
    torch.distributed.barrier()  # every rank's shards are on disk before older ones go
    if nodes.is_node_leader():  # each host prunes its own run directory
        prune_checkpoints(out, cfg.save_total_limit)
