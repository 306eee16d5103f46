"""Run by tests/test_microbatch.py under `deepspeed --num_gpus 2`: each rank trains one update on its own two
batches (grad_accum 2) in micro-batches of 3 rows at ZeRO `stage` with plain SGD (lr 1), dapo (a token normaliser
over both ranks), gradient checkpointing on; rank 0 writes the full weights before and after the update.

    deepspeed --num_gpus 2 tests/zero3_update_probe.py STAGE OUT_FILE [PACK_TOKENS]

PACK_TOKENS: packed forwards of at most that many tokens (tests/test_pack_bound.py), else the default.
"""
from __future__ import annotations

import sys

import deepspeed
import torch
from test_microbatch import config, full_weights, make_batch, sgd_engine

from trainer.objective.update import new_round, train_update


def main() -> None:
    stage, out, *pack = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # launcher: --local_rank=N
    stage = int(stage)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = config("dapo", "token", grad_accum=2)
    if pack:
        cfg.pack_tokens = int(pack[0])
    engine = sgd_engine(deepspeed, stage, grad_accum=2, gradient_checkpointing=True)
    batches = [make_batch(engine.module.config.vocab_size, seed) for seed in (2 * rank + 1, 2 * rank + 2)]
    before = full_weights(deepspeed, engine)  # a collective under ZeRO-3: every rank
    train_update(engine, new_round(batches, cfg, "cpu"), cfg)
    after = full_weights(deepspeed, engine)
    if rank == 0:
        torch.save({"before": before, "after": after, "global_steps": engine.global_steps}, out)
    torch.distributed.barrier()
    print(f"rank{rank} PROBE DONE", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
