"""Step time of a two-host run against the same run on one host (issue 23; not a test). Needs root
(network namespaces, tests/netns.py). Prints figures; the last line is one JSON object.

    .venv/bin/python bench/multihost_step.py [--steps 20] [--rounds 2]

Both sides: the ref server in a namespace of its own, the same trainer config (tiny model, 2 CPU ranks,
gloo, no genonly worker, so that the ranks' own work is what is timed), started with the README's
commands (`python -m trainer.dist.hosts`, what launch.sh runs). Two hosts: `trainer-host --nodes 2 --gpus 1`
in two namespaces (the ranks talk over veth + bridge). One host: `trainer-host --nodes 1 --gpus 2` in one
namespace. Reported: the
median `step_s` of each run's metrics (steps after the first two), runs alternating A B A B.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from netns import Hosts, can_make_namespaces  # noqa: E402

TOY = ["--model", "tiny", "--data", "arith", "--system_prompt", "", "--reward_fns", "toy_rewards:digit_fraction",
       "--max_new_tokens", "8", "--num_pre_Q", "8", "--temperature", "1.0", "--seed", "1", "--Q_batch_size", "2",
       "--save_steps", "1000"]


SKIPPED = 77  # --smoke where this machine cannot make namespaces (tests/test_bench_smoke.py skips, as test_multihost)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_REF_TOKEN": "bench-token-42"}


def run(hosts: Hosts, url: str, base: Path, nodes: int, steps: int) -> list[float]:
    """One training run; returns its step_s figures after the first two steps."""
    names = ["t0", "t1"][:nodes]
    procs = []
    for rank, name in enumerate(names):
        run_dir = base / f"{name}-{nodes}-{time.time_ns()}"
        # what `launch.sh trainer-host` runs (minus its venv check, which is not what is timed)
        cmd = [sys.executable, "-m", "trainer.dist.hosts", "trainer-host", "--nodes", str(nodes),
               "--node-rank", str(rank), "--master-addr", hosts.addr["t0"], "--gpus", str(2 // nodes), "--ref-url", url,
               "--run-dir", str(run_dir), "--", *TOY, "--all_steps", str(steps)]
        run_dir.mkdir(parents=True)
        with open(run_dir / "launch.log", "wb") as log:
            procs.append((subprocess.Popen(hosts.cmd(name, cmd), cwd=REPO, env=env(), stdout=log,
                                           stderr=subprocess.STDOUT), run_dir))
    for p, run_dir in procs:
        if p.wait(900) != 0:
            raise RuntimeError(f"{run_dir} failed:\n{(run_dir / 'launch.log').read_text()[-3000:]}")
    rows = [json.loads(line) for line in (procs[0][1] / "metrics.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in rows if r["step"] > 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="Optimizer steps per run.")
    p.add_argument("--rounds", type=int, default=2, help="Pairs of runs (two hosts, one host).")
    p.add_argument("--smoke", action="store_true", help="The test suite's short run: --steps 3 --rounds 1 (exit "
                                                        "77, skipped, where network namespaces cannot be made).")
    a = p.parse_args()
    if a.smoke:  # ~50 CPU-s, nearly all the runs' start-up (steps 1-3 take ~0.5 s each; measured, 2026-11-27)
        a.steps, a.rounds = 3, 1  # step 3 is timed (the first two are not)
    if a.steps < 3:
        p.error("--steps must be >= 3 (the first two steps are not timed)")
    why = can_make_namespaces()
    if why:
        print(f"cannot run: {why}")
        sys.exit(SKIPPED if a.smoke else 1)
    base = Path(tempfile.mkdtemp(prefix="multihost_bench."))
    times: dict[int, list[float]] = {1: [], 2: []}
    with Hosts(["ref", "t0", "t1"]) as hosts:
        url = f"http://{hosts.addr['ref']}:59875"
        with open(base / "ref_server.log", "wb") as log:
            ref = subprocess.Popen(hosts.cmd("ref", [sys.executable, "-m", "ref_server", "--model", "tiny",
                                                     "--host", hosts.addr["ref"], "--device", "cpu"]),
                                   cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            for r in range(a.rounds):
                for nodes in (2, 1):
                    s = run(hosts, url, base, nodes, a.steps)
                    times[nodes] += s
                    print(f"round {r}: {nodes} host(s): median step {statistics.median(s):.3f} s over {len(s)} steps")
        finally:
            ref.kill()
            ref.wait(30)
    shutil.rmtree(base)  # the runs' folders and logs, kept only when the bench failed
    two, one = statistics.median(times[2]), statistics.median(times[1])
    print(f"two hosts {two:.3f} s/step, one host {one:.3f} s/step: ratio {two / one:.2f}")
    print(json.dumps({"bench": "multihost_step", "steps_per_run": a.steps, "rounds": a.rounds,
                      "two_hosts_step_s": round(two, 4), "one_host_step_s": round(one, 4),
                      "ratio": round(two / one, 3)}))


if __name__ == "__main__":
    main()
