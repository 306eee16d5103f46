"""GRPO trainer entry point.

    deepspeed trainer/main.py [--config FILE] [--key value ...]      # train (DeepSpeed ranks)
    python trainer/main.py genonly [--config FILE] [--key value ...]  # generate-only worker

Follow one batch: trainer/worker.py (or a rank itself, trainer/batches.py) samples a group
(trainer/rollout.py), rewards it (trainer/rewards/) and uploads it; the ref server scores it with
reference logprobs; trainer/loop.py takes it, computes the GRPO loss (trainer/objective/grpo.py) and steps
the DeepSpeed engine (trainer/engine.py).
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "train"
    if argv and argv[0] == "genonly":
        mode, argv = "genonly", argv[1:]
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    cfg = load_config_or_exit(GRPOConfig, argv, prog="trainer/main.py", ignore_unknown=("local_rank",),
                              description=DESCRIPTION, epilog=EPILOG)
    if mode == "genonly":
        from trainer.worker import genonly
        genonly(cfg)
    else:
        from trainer.loop import train
        train(cfg)


if __name__ == "__main__":
    main()
