"""Exact resume of the data order: each rank's and worker's prompt-sampler position and RNG state.

Ranks: rank 0 writes every rank's state as OUTPUT_DIR/ds/<tag>/data_state.json before DeepSpeed
writes the checkpoint of <tag> (so `latest` never points at a checkpoint without one); on --resume
each rank takes its own entry back. Workers keep theirs in OUTPUT_DIR/worker<N>_data_state.json,
rewritten after every round. JSON, not pickles: readable, and nothing is unpickled.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import random
from pathlib import Path

import torch

from trainer.data.loading import PromptSampler

log = logging.getLogger("trainer")


def capture(sampler) -> dict:
    """This process's data state: sampler position and the RNG streams generation draws from."""
    py = random.getstate()
    state = {"sampler": sampler.state_dict(),
             "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "python_rng": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available():
        state["cuda_rng"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore(sampler, state: dict) -> None:
    """Put a captured state back (the sampler checks that data, seed and sharding are the same)."""
    sampler.load_state_dict(state["sampler"])
    raw = torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8)
    torch.set_rng_state(raw.clone())
    v, internal, gauss = state["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    if "cuda_rng" in state and torch.cuda.is_available():
        cuda = torch.frombuffer(bytearray(base64.b64decode(state["cuda_rng"])), dtype=torch.uint8)
        torch.cuda.set_rng_state(cuda.clone())


def write_json(path: Path, obj) -> None:
    """Atomic write (temp file + rename): a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def save_rank_states(ds_dir: Path, tag: str, states: list[dict]) -> None:
    """Rank 0: every rank's data state, next to the DeepSpeed checkpoint `tag`."""
    write_json(ds_dir / tag / "data_state.json", {"world_size": len(states), "ranks": states})


def load_rank_state(ds_dir: Path, rank: int, world: int) -> dict | None:
    """This rank's data state from the checkpoint `latest` points at; None for a checkpoint without one."""
    latest = ds_dir / "latest"
    if not latest.is_file():
        return None
    path = ds_dir / latest.read_text().strip() / "data_state.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved["world_size"] != world:
        raise ValueError(f"{path}: saved by {saved['world_size']} ranks, resuming with {world}; the data order "
                         f"cannot continue exactly (start a new run, or resume with the same number of ranks)")
    return saved["ranks"][rank]


def rank_sampler(examples, seed: int, ds_dir: Path, start_step: int, rank: int, world: int):
    """This rank's prompt sampler: fresh, or on --resume (start_step > 0) where the checkpoint left it."""
    sampler = PromptSampler(examples, seed=seed, shard=rank, num_shards=world)
    if start_step == 0:
        return sampler
    state = load_rank_state(ds_dir, rank, world)
    if state is None:
        log.warning("the checkpoint holds no data state (saved by an older version): prompts restart from a "
                    "seed offset, so some may repeat or be skipped")
        return PromptSampler(examples, seed=seed + 7919 * start_step, shard=rank, num_shards=world)
    restore(sampler, state)
    log.info("data order resumed: epoch %d, position %d", sampler.epoch, state["sampler"]["pos"])
    return sampler


def worker_state_path(output_dir: str, worker_id: int) -> Path:
    return Path(output_dir) / f"worker{worker_id}_data_state.json"
