"""Faults with real processes on 127.0.0.1: the system keeps working and loses nothing.

- the ref server is SIGKILLed mid-run and started again on the same port: ranks and the genonly worker
  retry with backoff, log the outage once and its end, and the run completes every step;
  batches that died with the server are counted (lost_batches) and regenerated;
- the genonly worker is SIGKILLed: the trainer falls back to generating itself after get_wait;
- the trainer (the deepspeed launcher's whole process group) is SIGKILLed after a checkpoint and
  resumed with --resume true: no duplicate or missing step rows;
- SIGTERM to the ref server while it scores: uploads get 503, the batch is finished and handed out, exit 0;
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, find_free_port, run_process_group, start_ref_server
from test_e2e import TOY, env, read_rows
from test_ref_server import make_batch

from common.wire.protocol import decode_scored, encode_rollout

pytestmark = pytest.mark.slow


def rows_of(run_dir: Path) -> list[dict]:
    try:
        return read_rows(run_dir)
    except (FileNotFoundError, ValueError):  # not there yet, or a row half written
        return []


def wait_for(cond, timeout: float, what: str, procs: tuple = (), poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        for p, log in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: process exited with {p.returncode} while waiting:\n"
                                     f"{Path(log).read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(poll)


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    """Own process group (killed as a whole at the end), output to a file."""
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


def deepspeed_cmd(run_dir: Path, url: str, *args: str) -> list[str]:
    return [str(REPO / ".venv" / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(find_free_port()),
            "trainer/main.py", *TOY, "--Q_batch_size", "2", "--ref_server", url, "--output_dir", str(run_dir), *args]


def worker_cmd(url: str, *args: str) -> list[str]:
    return [sys.executable, "trainer/main.py", "genonly", *TOY, "--Q_batch_size", "2", "--ref_server", url,
            "--num_gen_workers", "1", *args]


def process_lines(log: str, tag: str) -> list[str]:
    return [line for line in log.splitlines() if f"[{tag}]" in line]


# --------------------------------------------------------------------------- one run, three faults
ALL_STEPS, SAVE_STEPS = 16, 3


@pytest.fixture(scope="module")
def fault_run(tiny_model_dir, tmp_path_factory):
    """One run (trainer with 2 ranks + 1 genonly worker), three faults in turn (one DeepSpeed start-up saved
    per fault: they dominate the time on CPU):
    1. SIGKILL the ref server after 2 steps, restart it on the same port 3 s later;
    2. once training goes on, SIGKILL the worker (the trainer must generate itself after get_wait);
    3. after a checkpoint and a step beyond it, SIGKILL the trainer's whole process group; resume it."""
    tmp = tmp_path_factory.mktemp("faults")
    run_dir, port = tmp / "run", find_free_port()
    url = f"http://127.0.0.1:{port}"
    tlog, wlog = tmp / "trainer.log", tmp / "worker.log"
    args = ("--all_steps", str(ALL_STEPS), "--save_steps", str(SAVE_STEPS), "--num_gen_workers", "1", "--lr", "1e-3")
    fig: dict = {}
    trainer = worker = None
    try:
        with start_ref_server(tiny_model_dir, "--device", "cpu", port=port) as srv1:
            # a short queue ahead of the trainer: little of the worker's output outlives it
            worker = spawn(worker_cmd(url, "--worker_max_queued", "2"), wlog)
            trainer = spawn(deepspeed_cmd(run_dir, url, *args, "--get_wait", "3"), tlog)
            wait_for(lambda: len(rows_of(run_dir)) >= 2, 300, "first 2 steps", ((trainer, tlog),))
            st = requests.get(url + "/stats", timeout=10).json()
            fig["in_dead_server"] = st["uploads_accepted"] - st["batches_served"]  # queued or scored, not taken
            srv1.stop(signal.SIGKILL)
            fig["server_killed_at_rows"] = len(rows_of(run_dir))
            t_kill = time.monotonic()
        time.sleep(3)  # down for a while: the clients meet the outage
        t_start = time.monotonic()
        with start_ref_server(tiny_model_dir, "--device", "cpu", port=port) as srv2:
            t_up = time.monotonic()
            n = fig["rows_at_restart"] = len(rows_of(run_dir))
            wait_for(lambda: len(rows_of(run_dir)) > n, 240, "a new step after the restart", ((trainer, tlog),))
            t_row = time.monotonic()
            fig.update(downtime_s=t_up - t_kill, server_start_s=t_up - t_start, recovery_s=t_row - t_up,
                       recovery_from_start_s=t_row - t_start)
            wait_for(lambda: "is back" in wlog.read_text(errors="replace"), 120, "worker back", ((worker, wlog),))
            kill_group(worker)
            k = fig["worker_killed_at_rows"] = len(rows_of(run_dir))
            assert k <= ALL_STEPS - 3, f"too late to test the fallback and the trainer kill ({k} rows)"

            def self_fed_and_past_a_checkpoint() -> bool:
                """The ranks generated for themselves since the worker died, and a step ran beyond the
                newest checkpoint (so the kill below loses a step that --resume must redo)."""
                rows, latest = rows_of(run_dir), run_dir / "ds" / "latest"
                ckpt = int(latest.read_text().strip().removeprefix("step") or 0) if latest.is_file() else 0
                own = any(r["gen_s"] > 0 for r in rows if r["step"] > k + 1)
                return own and ckpt > 0 and len(rows) > ckpt

            wait_for(self_fed_and_past_a_checkpoint, 240, "own generation and a step past a checkpoint",
                     ((trainer, tlog),))
            kill_group(trainer)  # SIGKILL to the launcher's whole process group: launcher and both ranks
            fig["rows_at_trainer_kill"] = rows_of(run_dir)
            fig["trainer_killed_rows"] = [r["step"] for r in fig["rows_at_trainer_kill"]]
            fig["checkpoint"] = (run_dir / "ds" / "latest").read_text().strip()
            # the worker is dead: a short get_wait, not 3 s a step for batches that cannot come (~20 s of the
            # fixture); still num_gen_workers 1, so the resumed rank 0 publishes weights (meeting the newer ones)
            resumed = run_process_group(deepspeed_cmd(run_dir, url, *args, "--get_wait", "0.5", "--resume", "true"),
                                        cwd=REPO, env=env(), timeout=400)  # past it: launcher and ranks stopped too
            fig["resume_rc"], fig["resume_out"] = resumed.returncode, resumed.stdout + resumed.stderr
            fig["server_log"] = srv2.log()
    finally:
        for p in (trainer, worker):
            if p is not None and p.poll() is None:
                kill_group(p)
    return run_dir, tlog.read_text(errors="replace"), wlog.read_text(errors="replace"), fig


def test_server_restart_clients_recover(fault_run):
    run_dir, tlog, _, fig = fault_run
    rows = read_rows(run_dir)
    print(f"\nserver SIGKILL after {fig['server_killed_at_rows']} steps; batches in the dead server (queued or "
          f"scored, not fetched): {fig['in_dead_server']}; lost_batches counted by the trainer: "
          f"{sum(r.get('lost_batches', 0) for r in rows):.0f}")
    print(f"down {fig['downtime_s']:.1f} s (restart took {fig['server_start_s']:.1f} s); recovery: first new metrics "
          f"row {fig['recovery_s']:.1f} s after the restarted server was healthy "
          f"({fig['recovery_from_start_s']:.1f} s after its start)")
    assert fig["rows_at_restart"] < len(fig["trainer_killed_rows"])  # steps were trained after the restart
    assert fig["recovery_s"] < 120 and "Traceback" not in tlog


def test_clients_log_the_outage_once_and_its_end(fault_run):
    _, tlog, wlog, _ = fault_run
    noticed = {}
    for tag, log in (("rank0", tlog), ("rank1", tlog), ("worker0", wlog)):
        lines = process_lines(log, tag)
        down = [ln for ln in lines if "retrying with backoff" in ln]
        back = [ln for ln in lines if "is back after" in ln]
        # once per outage, not once per retry (a rank blocked in a collective meanwhile may not see it at all)
        assert len(down) <= 1 and len(back) == len(down), (tag, down, back)
        noticed[tag] = len(down)
        print(f"{tag}: {down[0].strip()[-160:] if down else '-'}\n  {back[0].strip() if back else ''}")
    assert noticed["worker0"] == 1 and noticed["rank0"] + noticed["rank1"] >= 1, noticed
    assert "Traceback" not in wlog


def test_lost_batches_are_counted_not_waited_for(fault_run):
    """The metric is in every row; steps after the restart came within a bounded wait (nothing awaited forever)."""
    run_dir, tlog, _, fig = fault_run
    rows = read_rows(run_dir)
    assert all("lost_batches" in r for r in rows)
    after = [r for r in rows if r["step"] > fig["rows_at_restart"]]
    assert after and all(r["wait_s"] < 120 for r in after)
    lost = sum(r["lost_batches"] for r in rows)
    warned = len(re.findall(r"uploaded batch\(es\) lost with the ref server", tlog + fig["resume_out"]))
    assert (lost > 0) == (warned > 0)  # the metric and the log agree


def test_worker_killed_trainer_generates_itself(fault_run):
    _, _, _, fig = fault_run
    rows = fig["rows_at_trainer_kill"]  # the first trainer's rows (the resumed one re-ran those past the checkpoint)
    k = fig["worker_killed_at_rows"]
    after = [r for r in rows if r["step"] > k + 1]  # +1: a batch may still have been in the pipe
    print(f"\nworker SIGKILL at {k} rows; gen_s per step: {[(r['step'], round(r['gen_s'], 2)) for r in rows]}")
    # The ranks generate for themselves once the queue runs dry (a round of Q_batch_size prompts may
    # feed more than one step, so not every step shows gen_s > 0), and no step stalls waiting.
    assert after and any(r["gen_s"] > 0 for r in after), [(r["step"], r["gen_s"]) for r in rows]
    assert all(r["wait_s"] < 60 for r in after), [(r["step"], r["wait_s"]) for r in rows]


def test_trainer_sigkill_then_resume(fault_run):
    run_dir, _, _, fig = fault_run
    assert fig["resume_rc"] == 0, fig["resume_out"][-4000:]
    ckpt = int(fig["checkpoint"].removeprefix("step"))
    killed = fig["trainer_killed_rows"]
    assert killed[:ckpt] == list(range(1, ckpt + 1)) and len(killed) > ckpt
    assert f"at step {ckpt}" in fig["resume_out"] and "resumed from" in fig["resume_out"]
    steps = [r["step"] for r in read_rows(run_dir)]
    print(f"\ntrainer SIGKILL with metrics rows {killed} (checkpoint {fig['checkpoint']}); after --resume: {steps}")
    assert steps == list(range(1, ALL_STEPS + 1))  # nothing missing, nothing twice
    assert "training done" in fig["resume_out"]
    # the server kept the killed run's newer weights: the resumed trainer says so and goes on (no crash on 409)
    assert "Traceback" not in fig["resume_out"]


# --------------------------------------------------------------------------- SIGTERM while scoring
def test_sigterm_finishes_the_batch_being_scored(tiny_model_dir):
    # One big upload (32 rows x 1024 tokens) takes a while to score: SIGTERM arrives mid-forward.
    with start_ref_server(tiny_model_dir, "--device", "cpu", "--score-token-budget", "4096",
                          "--drain-timeout", "30") as srv:
        big = make_batch([512] * 32, [512] * 32, seed=3, producer_id="big")
        queued = make_batch([4], [4], seed=4, producer_id="queued")
        assert requests.post(srv.url + "/upload", data=encode_rollout(big), timeout=60).status_code == 202
        wait_for(lambda: requests.get(srv.url + "/health", timeout=10).json()["queues"]["scoring"], 30,
                 "scoring started", poll=0.01)
        assert requests.post(srv.url + "/upload", data=encode_rollout(queued), timeout=60).status_code == 202
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: requests.get(srv.url + "/health", timeout=10).json()["status"] == "stopping", 10,
                 "stopping")
        r = requests.post(srv.url + "/upload", data=encode_rollout(make_batch([3], [3])), timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"] and r.headers["Retry-After"]
        scoring_at_503 = requests.get(srv.url + "/health", timeout=10).json()["queues"]["scoring"]

        def fetched():
            r = requests.get(srv.url + "/get?wait=1", timeout=30)
            return decode_scored(r.content) if r.status_code == 200 else None

        s = wait_for(fetched, 120, "the batch being scored", poll=0.1)
        assert s.batch_id == big.batch_id and s.ref_logps.shape == (32, 512)
        assert srv.proc.wait(60) == 0
        log = srv.log()
    print(f"\nSIGTERM mid-forward (still scoring at the 503: {scoring_at_503}); batch handed out and exit 0 "
          f"{time.monotonic() - t0:.1f} s after the signal")
    assert "ref server stopped" in log and "1 queued upload(s) not scored" in log and "not fetched" not in log
