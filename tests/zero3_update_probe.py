"""Read by tests/test_pack_bound.py, run in tests/rank_probes.py's two real DeepSpeed ranks: each rank trains one
update on its own two batches (grad_accum 2) in micro-batches of 3 rows with plain SGD (lr 1), dapo (a token
normaliser over both ranks), gradient checkpointing on, for each entry of `entries` in turn (a fresh engine from the
same weights each); rank 0 writes {entry: the full weights before and after the update} to `out`.

An entry is a ZeRO stage, `S`, or `S@P`: stage S with packed forwards of at most P tokens (pack_tokens), else the
default.
"""
from __future__ import annotations

import dataclasses

import torch
from test_microbatch import config, full_weights, make_batch, sgd_engine

from trainer.objective.update import new_round, train_update


def run(entries, out: str, deepspeed, rank: int) -> None:
    runs = {}
    for entry in entries:
        stage, _, pack = entry.partition("@")
        stage, cfg = int(stage), config("dapo", "token", grad_accum=2)
        if pack:
            cfg = dataclasses.replace(cfg, pack_tokens=int(pack))
        engine = sgd_engine(deepspeed, stage, grad_accum=2, gradient_checkpointing=True)
        batches = [make_batch(engine.module.config.vocab_size, seed) for seed in (2 * rank + 1, 2 * rank + 2)]
        before = full_weights(deepspeed, engine)  # a collective under ZeRO-3: every rank
        train_update(engine, new_round(batches, cfg, "cpu"), cfg)
        after = full_weights(deepspeed, engine)
        runs[entry] = {"before": before, "after": after, "global_steps": engine.global_steps,
                       "zero_stage": engine.zero_optimization_stage()}
        print(f"rank{rank} stage {entry} updated", flush=True)
        del engine
    if rank == 0:
        torch.save(runs, out)
    torch.distributed.barrier()
