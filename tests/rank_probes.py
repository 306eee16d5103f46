"""Two real DeepSpeed ranks (gloo, CPU) for the probes of three test files, one after the other in the same ranks:
a launch each cost a DeepSpeed start-up of two ranks (the launcher, its runner, two imports of torch, transformers
and DeepSpeed: ~12 CPU-s), for probes of a few seconds. Run once a suite by tests/conftest.py's `rank_probes`
fixture, whichever of the three files asks first; each probe prints its own lines, read by its file:

- tests/eval_shard_probe.py: the in-training eval at ZeRO stages EVAL_STAGES (tests/test_eval_shard.py);
- tests/zero3_update_probe.py: one update for each of UPDATES, rank 0 writes OUT_DIR/updates.pt
  (tests/test_pack_bound.py);
- tests/zero3_probe.py: ZeRO-3 ranks whose completion lengths differ, LOCKSTEP_STEPS steps of each scenario of
  LOCKSTEP (tests/test_zero3_lockstep.py).

Then `rank{r} PROBES DONE`.

    deepspeed --num_gpus 2 tests/rank_probes.py MODEL_DIR OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

EVAL_STAGES = (0, 2)
UPDATES = ("0", "3", "3@12")  # ZeRO stage [@ pack_tokens]: 12 is tests/test_pack_bound.py's PACK
LOCKSTEP_STEPS = 2
LOCKSTEP = (["micro_batch_size", "3"],  # scenario 0: forwards as the trainer chooses them
            ["micro_batch_size", "3", "pack_tokens", "64", "padding_free", "true"])  # 1: packed, whatever auto chose
DIST_TIMEOUT = 120  # s: a rank out of lockstep fails after this instead of hanging the suite


def main() -> None:
    # imported here: the test files import this module's constants in pytest's own process, without the probes
    import eval_shard_probe
    import torch
    import zero3_probe
    import zero3_update_probe

    from trainer.deepspeed_policy import init_deepspeed

    model, out_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # launcher: --local_rank=N
    cfg = zero3_probe.probe_config(model, ["dist_timeout", str(DIST_TIMEOUT)])
    deepspeed, rank, world, on_gpu = init_deepspeed(cfg)
    eval_shard_probe.run(model, EVAL_STAGES, deepspeed, rank, world, on_gpu)
    zero3_update_probe.run(UPDATES, str(Path(out_dir) / "updates.pt"), deepspeed, rank)
    zero3_probe.run(model, LOCKSTEP_STEPS, LOCKSTEP, deepspeed, rank, on_gpu)
    torch.distributed.barrier()
    print(f"rank{rank} PROBES DONE", flush=True)


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1 CPU-s a rank)
    exit_cleanly(0)
