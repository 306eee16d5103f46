"""How many trainer ranks a CPU run starts when the user names none (`launch.sh train` without --gpus): one or two,
from what each cost at the model's shape on this kind of CPU (issue 62). `--gpus N` always wins.

    ranks, batch_args, why = auto_cpu_ranks(cfg, cores=2)   # (1, ["--train_batch_groups", "6"] for the demo, "...")

A step is ranks x train_batch_groups x grad_accum groups, and the CPU default was 2 ranks: configs (the demo's
train_batch_groups 3: 6 groups of 8 a step) are written for it. One rank instead takes twice the groups
(train_batch_groups x 2), so the step a config describes is the same either way; the plan says so in one line.

Why one rank can be cheaper: on 2 cores the ref server, a worker and two ranks share the cores, and the second rank
is a second DeepSpeed process with its own fixed per-op cost, its own optimizer step and a gloo all-reduce of every
gradient. Measured only on 2-core hosts and at the demo's shape: elsewhere (more cores, a model more than ten times
larger or smaller) it stays 2 ranks, the former default, and the plan says the choice was not measured there. No
torch imported (launch.sh's placement runs this).
"""
from __future__ import annotations

import dataclasses
import math
import os

from common.placement.gen_choice import cpu_class, model_params

FORMER_DEFAULT = 2
MEASURED_CORES = 2  # every run of RANK_COSTS was on a 2-core host


@dataclasses.dataclass(frozen=True)
class RankCost:
    """One measured shape: the whole run's CPU-seconds and wall (every process), 2 ranks x g groups against
    1 rank x 2g groups, the same steps of the same groups."""
    shape: str
    params: float
    two_cpu_s: float
    one_cpu_s: float
    two_wall_s: float
    one_wall_s: float


# docs/benchmarks.md, "The number of CPU ranks": bench/vs_trl.py --only ours, 90 steps of the demo (64 completions a
# step), `--ranks 1 --ours-args "--train_batch_groups 8"` against the default 2 ranks x 4 groups, on a 2-core AMD
# EPYC (Zen 5, AVX-512 BF16): natively (vLLM worker, bf16) and with ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 (HF worker, float32), 2026-12-02 at 8c4360c. A 2-core Xeon, AVX2 emulated, 100 steps at
# 4588edf agreed: 131.7 against 142.4 CPU-s, 82.3 against 87.5 s.
RANK_COSTS: dict[str, tuple[RankCost, ...]] = {
    "avx512_bf16": (RankCost("tiny (the demo)", 1.15e6, 80.7, 72.3, 61.3, 53.9),),
    "avx2": (RankCost("tiny (the demo)", 1.15e6, 103.1, 89.4, 66.3, 56.6),),
}


def host_cores() -> int:
    """The cores this process may run on (a cgroup or taskset narrows os.cpu_count())."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_cpu_ranks(cfg, cores: int | None = None, env=None, flags: set[str] | None = None,
                   params: float | None = None) -> tuple[int, list[str], str]:
    """(ranks, trainer args that keep the step's groups, the plan's line saying why)."""
    cores = host_cores() if cores is None else cores
    if cores > MEASURED_CORES:
        return FORMER_DEFAULT, [], (f"ranks auto: {FORMER_DEFAULT} (this host has {cores} cores; one rank against "
                                    f"two was measured on {MEASURED_CORES}-core hosts only; --gpus N to choose)")
    params, unknown = model_params(cfg.model) if params is None else (params, "")
    if params is None:
        return FORMER_DEFAULT, [], f"ranks auto: {FORMER_DEFAULT} (the model's shape is unknown: {unknown})"
    cls = cpu_class(env, flags)
    near = [c for c in RANK_COSTS[cls] if abs(math.log10(c.params / params)) <= 1]
    if not near:
        return FORMER_DEFAULT, [], (f"ranks auto: {FORMER_DEFAULT} ({params / 1e6:.0f}M parameters: one rank against "
                                    f"two not measured within 10x of this shape on the {cls} CPU class; --gpus N "
                                    f"to choose)")
    c = min(near, key=lambda c: abs(math.log10(c.params / params)))
    if c.two_cpu_s <= c.one_cpu_s:
        return FORMER_DEFAULT, [], f"ranks auto: 2 ({cls} CPU, {c.shape}: 2 ranks {c.two_cpu_s:g} vs 1 rank " \
                                   f"{c.one_cpu_s:g} CPU-s, docs/benchmarks.md)"
    groups = cfg.train_batch_groups * FORMER_DEFAULT
    return 1, ["--train_batch_groups", str(groups)], (
        f"ranks auto: 1 ({cls} CPU, {cores} cores, nearest measured shape {c.shape}: 1 rank {c.one_cpu_s:g} CPU-s / "
        f"{c.one_wall_s:g} s vs 2 ranks {c.two_cpu_s:g} / {c.two_wall_s:g} s, docs/benchmarks.md); train_batch_groups "
        f"{cfg.train_batch_groups} -> {groups}, so a step is still {groups * cfg.grad_accum} groups (--gpus 2: two "
        f"ranks of {cfg.train_batch_groups})")
