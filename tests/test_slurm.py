"""A run on a real Slurm (issue 63): slurmctld and one slurmd per host, each host a network namespace with a UTS
name of its own (tests/slurm_cluster.py), running Debian's slurm-wlm with munge (scripts/setup.sh --slurm).

From a user's folder (no PYTHONPATH), the login host submits examples/slurm/train.sbatch on 2 nodes with one worker
node: node 0 runs the ref server and the trainer host (one CPU rank: the one "GPU" Slurm gives the step), node 1
the genonly worker. After a few steps the batch shell gets SIGUSR1 (`scancel --batch --signal=USR1`, what
`#SBATCH --signal=B:USR1@120` sends); the run saves a checkpoint, stops on both nodes with exit 75 and the script
requeues the job; the requeued job resumes from that checkpoint exactly and reaches its last step. `launch.sh
status --run-dir` works from the login host meanwhile and after. Skipped, with the reason, where namespaces cannot
be made or Slurm is not installed.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, user_env
from slurm_cluster import SlurmCluster, missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing()), reason=str(missing()))]

ALL_STEPS = 10
STOP_AFTER = 2  # steps logged before the batch shell gets SIGUSR1
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


def user_folder(base: Path) -> Path:
    """A user's folder: their reward module, data and config (absolute paths: every node reads them)."""
    user = base / "user"
    (user / "tasks").mkdir(parents=True)
    (user / "toy_rewards.py").write_text((REPO / "tests" / "toy_rewards.py").read_text())
    # ~0.8 s of scoring a step (16 completions): the signal, sent after STOP_AFTER steps, arrives mid-run
    (user / "paced_rewards.py").write_text("import time\nfrom toy_rewards import digit_fraction\n\n\n"
                                           "def paced(completion, ground_truth):\n    time.sleep(0.05)\n"
                                           "    return digit_fraction(completion, ground_truth)\n")
    data = user / "tasks" / "arith.jsonl"
    data.write_text("".join(f'{{"prompt": "{a} + {b} = ?", "ground_truth": "{a + b}"}}\n'
                            for a in range(1, 9) for b in range(1, 9)))
    cfg = {"model": "tiny", "data": str(data), "system_prompt": "", "reward_fns": ["paced_rewards:paced"],
           "max_new_tokens": 8, "num_pre_Q": 8, "temperature": 1.0, "seed": 1, "Q_batch_size": 2, "get_wait": 3,
           "lr": 1e-3, "all_steps": ALL_STEPS, "save_steps": ALL_STEPS}  # the stop's checkpoint is the only one
    (user / "grpo.json").write_text(json.dumps(cfg))
    (user / "long.json").write_text(json.dumps({**cfg, "all_steps": 100, "save_steps": 2}))  # cancelled mid-run
    return user


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def wait(ok, timeout: float, what: str, sc: SlurmCluster, run_dir: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = ok()
        if got:
            return got
        time.sleep(0.5)
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(run_dir.rglob("*.log")))
    out = "\n".join(p.read_text(errors="replace")[-3000:] for p in run_dir.parent.glob("user/slurm-*.out"))
    raise AssertionError(f"no {what} after {timeout:.0f} s\n{out}\n{logs}\n{sc.logs()}")


@pytest.fixture(scope="module")
def slurm_run(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm")
    user = user_folder(base)
    run_dir = user / "run"
    fig: dict = {}
    with SlurmCluster(base / "cluster", ["n0", "n1"], kill_wait=10) as sc:
        env = sc.env(**{k: v for k, v in user_env().items() if k != "SLURM_CONF"})
        env.update(CONFIG="grpo.json", RUN_DIR="run", WORKER_NODES="1", GRPO=str(REPO))
        sbatch = lambda e: sc.run(["sbatch", "--parsable", "--gpus-per-node=1", "--cpus-per-task=2",  # noqa: E731
                                   "--time=15", f"--output={user}/slurm-%j.out", str(SBATCH)], cwd=user, env=e)
        job = fig["job"] = submitted(sbatch(env))
        wait(lambda: len(rows(run_dir)) >= STOP_AFTER, 240, f"{STOP_AFTER} steps", sc, run_dir)
        fig["plan"] = sc.run(["bash", str(REPO / "launch.sh"), "slurm", "--run-dir", "run", "--worker-nodes", "1",
                              "--print-plan"], host="n0", cwd=user,
                             env={**env, "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_ID": job})
        fig["status_running"] = login_status(sc, user, env)
        fig["signal"] = sc.run(["scancel", "--batch", "--signal=USR1", job])
        fig["signalled_at"] = len(rows(run_dir))

        def stopped() -> dict | None:  # the first attempt's end, before the requeued job starts over
            end = run_dir / "run_end.json"
            rec = json.loads(end.read_text()) if end.is_file() else None
            return rec if rec and rec["exit_code"] == 75 else None

        fig["stopped"] = wait(stopped, 180, "the run stopping with exit 75", sc, run_dir)
        tag = (run_dir / "ds" / "latest").read_text().strip()
        fig["tag"] = tag
        fig["saved_state"] = json.loads((run_dir / "ds" / tag / "data_state.json").read_text())
        fig["status_stopped"] = login_status(sc, user, env)
        done = lambda: sc.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # noqa: E731
        wait(done, 300, "the requeued job ending", sc, run_dir)
        fig["job_end"] = sc.job(job)
        fig["status_end"] = login_status(sc, user, env)
        fig["out"] = "\n".join(p.read_text(errors="replace") for p in user.glob("slurm-*.out"))
        # scancel: SIGTERM to every process of the job, SIGKILL after KillWait; the last completed checkpoint stands
        run2 = user / "run2"
        job2 = submitted(sbatch({**env, "CONFIG": "long.json", "RUN_DIR": "run2"}))
        wait(lambda: len(rows(run2)) >= 3, 240, "3 steps of the job to cancel", sc, run2)
        fig["cancel"] = sc.run(["scancel", job2])
        wait(lambda: (run2 / "run_end.json").is_file() and sc.job(job2).get("JobState") == "CANCELLED", 120,
             "the cancelled job's end", sc, run2)
        fig["cancel_end"] = json.loads((run2 / "run_end.json").read_text())
        fig["cancel_latest"] = (run2 / "ds" / "latest").read_text().strip()
        fig["cancel_tags"] = sorted(p.name for p in (run2 / "ds").glob("step*"))
        fig["status_cancel"] = login_status(sc, user, env, "run2")
        fig["left_cancel"] = subprocess.run(["pgrep", "-af", str(run2)], capture_output=True, text=True).stdout
    fig["left"] = subprocess.run(["pgrep", "-af", str(base)], capture_output=True, text=True).stdout
    return run_dir, fig


def submitted(sub: subprocess.CompletedProcess) -> str:
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def login_status(sc: SlurmCluster, user: Path, env: dict, run: str = "run") -> subprocess.CompletedProcess:
    """`launch.sh status --run-dir` from the login host (ctl): the token the batch script left for its user."""
    return sc.run(["bash", str(REPO / "launch.sh"), "status", "--run-dir", run, "--token-file", f"{run}/ref_token"],
                  cwd=user, env=env, timeout=120)


def test_roles_from_the_allocation(slurm_run):
    run_dir, fig = slurm_run
    plan = fig["plan"]
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert re.match(r"node 0 n0 \(10\.214\.\d+\.3\): ref-server :\d+ \+ trainer-host 0/1", lines[0]), plan.stdout
    assert re.match(r"node 1 n1 \(10\.214\.\d+\.4\): workers 0\.\.0", lines[1]), plan.stdout
    status = fig["status_running"]
    assert status.returncode == 0, status.stdout + status.stderr
    # the ranks on node 0, the worker on node 1 (the addresses exist only in their namespaces)
    assert "trainer-rank0" in status.stdout and "worker0" in status.stdout, status.stdout
    assert (run_dir / "ref_server.log").is_file() and (run_dir / "trainer.log").is_file()
    assert "policy weights v" in (run_dir / "node1" / "worker0.log").read_text()
    token = (run_dir / "ref_token").read_text().strip()
    assert token not in fig["out"] and token not in fig["job_end"].get("Command", "")


def test_usr1_checkpoints_stops_and_requeues(slurm_run):
    run_dir, fig = slurm_run
    assert fig["signal"].returncode == 0, fig["signal"].stderr
    stopped = fig["stopped"]
    step = int(fig["tag"].removeprefix("step"))
    print(f"SIGUSR1 after {fig['signalled_at']} steps; stopped at step {step}: {stopped}")
    assert STOP_AFTER <= step < ALL_STEPS and stopped["last_step"] == step, (fig["tag"], stopped)
    assert "[sbatch] SIGUSR1" in fig["out"] and "the run ended with code 75" in fig["out"], fig["out"][-3000:]
    assert f"stopped at step {step} for a requeue" in (run_dir / "trainer.log").read_text()
    assert "exit 75" in fig["status_stopped"].stdout, fig["status_stopped"].stdout
    assert fig["job_end"]["Restarts"] == "1", fig["job_end"]


def test_requeued_job_resumes_exactly(slurm_run):
    run_dir, fig = slurm_run
    job = fig["job_end"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, fig["out"][-3000:])
    step = int(fig["tag"].removeprefix("step"))
    log = (run_dir / "trainer.log").read_text()
    assert re.search(rf"resumed from \S+ at step {step}\b", log), log[-3000:]
    pos = fig["saved_state"]["ranks"][0]["sampler"]["pos"]
    assert f"data order resumed: epoch {fig['saved_state']['ranks'][0]['sampler']['epoch']}, position {pos}" in log
    steps = [r["step"] for r in rows(run_dir) if "loss" in r]
    assert steps == list(range(1, ALL_STEPS + 1)), steps  # none lost, none twice
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert "exit 0" in fig["status_end"].stdout, fig["status_end"].stdout
    assert fig["left"] == "", fig["left"]  # nothing of the cluster or the run outlives the test


def test_scancel_stops_everything_and_the_last_checkpoint_stands(slurm_run):
    run_dir, fig = slurm_run
    assert fig["cancel"].returncode == 0, fig["cancel"].stderr
    end = fig["cancel_end"]
    print(f"cancelled: {end}; ds/latest {fig['cancel_latest']}; tags {fig['cancel_tags']}")
    assert end["exit_code"] == 143 and "stopped (SIGTERM)" in fig["status_cancel"].stdout, fig["status_cancel"]
    saved = int(fig["cancel_latest"].removeprefix("step"))
    assert saved >= 2 and saved % 2 == 0 and saved <= end["last_step"], (fig["cancel_latest"], end)
    # nothing newer than `latest` is left to be mistaken for a checkpoint (a save the TERM cut short is dropped)
    assert all(int(t.removeprefix("step")) <= saved for t in fig["cancel_tags"]), fig["cancel_tags"]
    assert fig["left_cancel"] == "", fig["left_cancel"]  # no process of the cancelled job on any node
