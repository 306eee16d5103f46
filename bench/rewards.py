"""Reward scoring throughput with and without the per-call timeout (issue 16: rewards that cannot freeze the run).

    python bench/rewards.py [--groups 400] [--group-size 8] [--rewards correct,format] [--repeats 3] [--timeout 10]

Completions are made from the demo's arith task (trainer/demo/arith.py): per group of `group-size`, some worked
solutions in the R1 format and some wrong or malformed ones, as a half-trained policy writes them. Each side
scores the same groups with trainer.rewards.scoring.RewardScorer (what rollouts call):

  in_process   reward_timeout = 0: the functions are called directly (no isolation, no timeout)
  timeout      reward_timeout = T: the calls go to the reward worker process (JSON lines over a pipe), each
               under its own deadline; the worker is started before timing (one-off, ~0.1 s)

overhead = 1 - timeout completions/s / in_process completions/s (best of `repeats` runs each, interleaved).
This is a benchmark, not a test. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.demo.arith import load_arith, solution_text  # noqa: E402
from trainer.rewards.scoring import RewardScorer  # noqa: E402


def make_groups(n_groups: int, size: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    examples = load_arith("train")
    groups = []
    for ex in rng.sample(examples, n_groups):
        good = solution_text(ex.prompt)
        wrong = good.replace(f"<answer>{ex.ground_truth}</answer>", f"<answer>{int(ex.ground_truth) + 1}</answer>")
        pool = [good, wrong, good.replace("</think>", ""), f"{ex.ground_truth}"]
        groups.append((ex, [rng.choice(pool) for _ in range(size)]))
    return groups


def run(scorer: RewardScorer, groups: list[tuple]) -> float:
    t0 = time.perf_counter()
    for ex, comps in groups:
        scorer.score_group(ex, comps)
    return sum(len(c) for _, c in groups) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=400)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rewards", default="correct,format")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="the test suite's seconds-long run: 20 groups, 1 repeat")
    a = p.parse_args(argv)
    if a.smoke:
        a.groups, a.repeats = 20, 1
    groups = make_groups(a.groups, a.group_size, a.seed)
    plain = RewardScorer(a.rewards, timeout=0)
    guarded = RewardScorer(a.rewards, timeout=a.timeout)
    guarded.score_group(*groups[0])  # start the worker outside the timed part
    best = {"in_process": 0.0, "timeout": 0.0}
    try:
        for _ in range(a.repeats):
            best["in_process"] = max(best["in_process"], run(plain, groups))
            best["timeout"] = max(best["timeout"], run(guarded, groups))
    finally:
        guarded.close()
    res = {"rewards": a.rewards, "completions": a.groups * a.group_size, "group_size": a.group_size,
           "in_process_completions_per_s": round(best["in_process"]),
           "timeout_completions_per_s": round(best["timeout"]),
           "overhead": round(1 - best["timeout"] / best["in_process"], 3),
           "us_per_completion_added": round(1e6 * (1 / best["timeout"] - 1 / best["in_process"]), 1)}
    print(f"in-process {res['in_process_completions_per_s']} completions/s, under timeout "
          f"{res['timeout_completions_per_s']} completions/s (+{res['us_per_completion_added']} us each)")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
