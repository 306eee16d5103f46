"""GRPO trainer entry point.

    deepspeed trainer/main.py [--config FILE] [--key value ...]      # train (DeepSpeed ranks)
    python trainer/main.py genonly [--config FILE] [--key value ...]  # generate-only worker

Follow one batch: trainer/worker.py (or a rank itself, trainer/batches.py) samples a group
(trainer/rollout.py), rewards it (trainer/rewards/) and uploads it; the ref server scores it with
reference logprobs; trainer/loop.py takes it, computes the GRPO loss (trainer/objective/grpo.py) and steps
the DeepSpeed engine (trainer/deepspeed_policy.py).
"""
from __future__ import annotations

import os
import sys

# `deepspeed trainer/main.py` (or `python trainer/main.py`) puts trainer/ first on sys.path, where our module names
# (data, evaluate, metrics...) would shadow same-named libraries: the checkout's root takes its place, so `common`
# and `trainer` import from it in any interpreter that has the dependencies (GRPO_PYTHON), installed or not.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

from common.config import GRPOConfig  # noqa: E402
from common.gc_pause import imports_without_gc  # noqa: E402
from common.settings.knobs import load_config_or_exit  # noqa: E402

DESCRIPTION = """GRPO trainer: the DeepSpeed ranks (started by `deepspeed trainer/main.py`), or with `genonly`
first, one generate-only worker. Usually started by launch.sh. Every option below is a GRPOConfig field
(common/config.py); option names take dashes or underscores and are never abbreviated."""
EPILOG = """Through launch.sh these options go after `--`:
    ./launch.sh train [launch.sh options] -- [these options]
Before `--` an option is launch.sh's own (./launch.sh --help). Where both have a name, the position says which:
    ./launch.sh train --config F        launch.sh's; it passes --config F on, here, to the ranks and the workers
    ./launch.sh train --ref-model M     the ref server's model (launch.sh's); after `--`, --ref_model is this one
    ./launch.sh train --worker-dtype D  launch.sh's; it passes --worker_dtype D on, here
A value given twice wins the second time: `./launch.sh train --config A -- --config B` reads B."""


def main(argv: list[str] | None = None, exit_when_done: bool = False) -> None:
    """exit_when_done (the script): a run that ended cleanly leaves without the interpreter's teardown."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "train"
    if argv and argv[0] == "genonly":
        mode, argv = "genonly", argv[1:]
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    cfg = load_config_or_exit(GRPOConfig, argv, prog="trainer/main.py", ignore_unknown=("local_rank",),
                              description=DESCRIPTION, epilog=EPILOG)
    try:
        if mode == "genonly":
            with imports_without_gc():  # torch and transformers: common/gc_pause.py
                from trainer.worker import genonly
            genonly(cfg)
        else:
            with imports_without_gc():  # torch, transformers and DeepSpeed
                from trainer.loop import train
            train(cfg)
    except Exception as e:  # noqa: BLE001 - the traceback is logged; the last line names the process and the cause
        sys.exit(die(cfg, mode, e))
    if exit_when_done and (mode == "train" or cfg.gen_backend == "hf" or cfg.vllm_tensor_parallel_size == 1):
        # done and closed: skip the ~2 s interpreter teardown (common/fast_exit.py; vLLM's own shutdown is an
        # atexit finalizer, which runs). A tensor-parallel vLLM engine's worker processes are left to a normal exit
        from common.fast_exit import exit_cleanly
        exit_cleanly(0)


def die(cfg: GRPOConfig, mode: str, e: Exception) -> int:
    """Log the traceback, then ONE last line: this process, the exception's type and the first line of its message
    (a reward's names the function, the row and its columns: trainer/rewards/scoring.py); also the run's
    diagnosis.txt (first writer wins), which launch.sh repeats as its last line. Exit code 1, or 7 for a producer
    that can never make a batch, 8 where no group's rewards spread (trainer/run/stall.py NothingToTrain)."""
    import logging
    import traceback

    from trainer.run.health import write_diagnosis
    from trainer.run.stall import NothingToTrain
    who = f"worker{cfg.worker_id}" if mode == "genonly" else f"rank {os.environ.get('RANK', '0')}"
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, NothingToTrain):  # its line names the process, the knob or the rewards: no traceback
        line, code = first, e.exit_code  # 7, or 8 for no reward spread (NoRewardSpread)
    else:
        line, code = f"{who}: {type(e).__name__}: {first}", 1
        logging.getLogger("trainer").error("%s", "".join(traceback.format_exception(e)).rstrip())
    if os.path.isdir(cfg.output_dir):  # launch.sh made the run directory
        write_diagnosis(cfg.output_dir, line)
    print(line, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    main(exit_when_done=True)
