"""A stop request (trainer/run/requeue.py) on a 2-rank `launch.sh train` run as a user runs it: `touch RUN/stop_request`
mid-run (what launch.sh slurm does on Slurm's SIGUSR1) ends the run after the step in progress, both ranks agreeing on
that step: its checkpoint holds both ranks' shards and data states, there is no `final`, and launch.sh exits 75.
tests/test_slurm.py runs the whole path (signal, requeue, resume) on a real Slurm with one rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import REPO, user_env
from test_e2e import TOY_USER

pytestmark = pytest.mark.slow


def test_stop_request_checkpoints_every_rank_and_exits_75(tiny_model_dir, tmp_path):
    (tmp_path / "toy_rewards.py").write_text((REPO / "tests" / "toy_rewards.py").read_text())
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arith.jsonl").write_text("".join(
        f'{{"prompt": "{a} + {b} = ?", "ground_truth": "{a + b}"}}\n' for a in range(1, 9) for b in range(1, 9)))
    run = tmp_path / "run"
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--skip-checks", "--run-dir", "run", "--workers", "0", "--gpus",
           "2", "--", *TOY_USER, "--Q_batch_size", "2", "--all_steps", "40", "--save_steps", "40"]
    with open(tmp_path / "launch.log", "wb") as log:
        p = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        end = time.monotonic() + 240
        metrics = run / "metrics.jsonl"
        while time.monotonic() < end and p.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        (run / "stop_request").write_text("")
        asked_at = len(metrics.read_text().splitlines())
        rc = p.wait(120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    out = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == 75, out[-3000:]
    tag = (run / "ds" / "latest").read_text().strip()
    step = int(tag.removeprefix("step"))
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()]
    print(f"asked after {asked_at} steps, stopped at step {step}")
    assert asked_at <= step < 40 and steps == list(range(1, step + 1)), (asked_at, step, steps)
    for rank in (0, 1):  # both ranks stopped at the same step, each with its shard and data state
        assert (run / "ds" / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
    assert json.loads((run / "ds" / tag / "data_state.json").read_text())["world_size"] == 2
    log = (run / "trainer.log").read_text()
    assert log.count(f"stopped at step {step} for a requeue") == 2, log[-3000:]
    assert not (run / "final").exists()
    assert json.loads((run / "run_end.json").read_text())["exit_code"] == 75
