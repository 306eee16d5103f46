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

# `deepspeed trainer/main.py` puts trainer/ first on sys.path, where our module names
# (data, evaluate, metrics...) would shadow same-named libraries. Packages come from `pip install -e .`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from common.config import GRPOConfig  # noqa: E402
from common.knobs import load_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "train"
    if argv and argv[0] == "genonly":
        mode, argv = "genonly", argv[1:]
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    cfg = load_config(GRPOConfig, argv, prog="trainer/main.py [genonly]", ignore_unknown=("local_rank",))
    if mode == "genonly":
        from trainer.worker import genonly
        genonly(cfg)
    else:
        from trainer.loop import train
        train(cfg)


if __name__ == "__main__":
    main()
