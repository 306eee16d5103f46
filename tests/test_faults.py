"""Faults with real processes on 127.0.0.1: the system keeps working and loses nothing.

- the ref server is SIGKILLed mid-run and started again on the same port: ranks and the genonly worker
  retry with backoff, log the outage once and its end, and the run completes every step;
  batches that died with the server are counted (lost_batches) and regenerated;
- the genonly worker is SIGKILLed: the trainer falls back to generating itself after get_wait;
- the trainer (the deepspeed launcher's whole process group) is SIGKILLed after a checkpoint and
  resumed with --resume true: no duplicate or missing step rows;
- SIGTERM to the ref server while it scores: uploads get 503, the batch is finished and handed out, exit 0;
- SIGINT to launch.sh: every child is stopped, no process of the run is left.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from common.protocol import decode_scored, encode_rollout
from conftest import REPO, find_free_port, start_ref_server
from test_e2e import TOY, env, read_rows
from test_ref_server import make_batch

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


# --------------------------------------------------------------------------- ref server killed + worker killed
ALL_STEPS = 8


@pytest.fixture(scope="module")
def server_restart_run(tiny_model_dir, tmp_path_factory):
    """One run: trainer (2 ranks) + 1 genonly worker; SIGKILL the server after 2 steps, restart it on the
    same port; once training goes on, SIGKILL the worker; the run must still finish."""
    tmp = tmp_path_factory.mktemp("faults")
    run_dir, port = tmp / "run", find_free_port()
    url = f"http://127.0.0.1:{port}"
    tlog, wlog = tmp / "trainer.log", tmp / "worker.log"
    figures: dict = {}
    trainer = worker = None
    try:
        with start_ref_server(tiny_model_dir, "--device", "cpu", port=port) as srv1:
            worker = spawn(worker_cmd(url), wlog)
            trainer = spawn(deepspeed_cmd(run_dir, url, "--all_steps", str(ALL_STEPS), "--save_steps", "1000",
                                          "--num_gen_workers", "1", "--get_wait", "3", "--lr", "1e-3"), tlog)
            wait_for(lambda: len(rows_of(run_dir)) >= 2, 300, "first 2 steps", ((trainer, tlog),))
            st = requests.get(url + "/stats", timeout=10).json()
            figures["in_dead_server"] = st["uploads_accepted"] - st["batches_served"]  # queued or scored, not taken
            srv1.stop(signal.SIGKILL)
            figures["killed_at_rows"] = len(rows_of(run_dir))
            t_kill = time.monotonic()
        time.sleep(3)  # down for a while: every client meets the outage
        t_start = time.monotonic()
        with start_ref_server(tiny_model_dir, "--device", "cpu", port=port) as srv2:
            t_up = time.monotonic()
            n = len(rows_of(run_dir))
            wait_for(lambda: len(rows_of(run_dir)) > n, 240, "a new step after the restart", ((trainer, tlog),))
            t_row = time.monotonic()
            figures.update(downtime_s=t_up - t_kill, server_start_s=t_up - t_start, recovery_s=t_row - t_up,
                           recovery_from_start_s=t_row - t_start, rows_at_restart=n)
            # the worker uploaded again after the outage (before we kill it)
            wait_for(lambda: "is back" in wlog.read_text(errors="replace"), 120, "worker back", ((worker, wlog),))
            kill_group(worker)
            figures["worker_killed_at_rows"] = len(rows_of(run_dir))
            rc = trainer.wait(400)
            figures["rc"] = rc
            figures["server_log"] = srv2.log()
    finally:
        for p in (trainer, worker):
            if p is not None and p.poll() is None:
                kill_group(p)
    return run_dir, tlog.read_text(errors="replace"), wlog.read_text(errors="replace"), figures


def test_server_restart_run_completes_every_step(server_restart_run):
    run_dir, tlog, _, fig = server_restart_run
    assert fig["rc"] == 0, tlog[-4000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, ALL_STEPS + 1))
    assert all("lost_batches" in r for r in rows)
    lost = sum(r["lost_batches"] for r in rows)
    print(f"\nserver SIGKILL after {fig['killed_at_rows']} steps; batches in the dead server (queued/scored, not "
          f"fetched): {fig['in_dead_server']}; trainer-counted lost_batches: {lost:.0f}")
    print(f"down {fig['downtime_s']:.1f} s (restart took {fig['server_start_s']:.1f} s); recovery: first new metrics "
          f"row {fig['recovery_s']:.1f} s after the restarted server was healthy "
          f"({fig['recovery_from_start_s']:.1f} s after its start)")
    assert "training done" in tlog


def test_clients_log_the_outage_once_and_its_end(server_restart_run):
    _, tlog, wlog, _ = server_restart_run
    noticed = {}
    for tag, log in (("rank0", tlog), ("rank1", tlog), ("worker0", wlog)):
        lines = process_lines(log, tag)
        down = [ln for ln in lines if "retrying with backoff" in ln]
        back = [ln for ln in lines if "is back after" in ln]
        # once per outage, not once per retry (a rank blocked in a collective meanwhile may not see it at all)
        assert len(down) <= 1 and len(back) == len(down), (tag, down, back)
        noticed[tag] = len(down)
        print(f"{tag}: {down[0].strip() if down else '-'}\n{' ' * len(tag)}  {back[0].strip() if back else ''}")
    assert noticed["worker0"] == 1 and noticed["rank0"] + noticed["rank1"] >= 1, noticed
    assert "Traceback" not in wlog


def test_lost_batches_are_counted_not_waited_for(server_restart_run):
    """What died with the server is regenerated: the steps after the restart come within a bounded time."""
    run_dir, tlog, _, fig = server_restart_run
    rows = read_rows(run_dir)
    after = [r for r in rows if r["step"] > fig["rows_at_restart"]]
    assert after and all(r["wait_s"] < 120 for r in after)
    lost = sum(r["lost_batches"] for r in rows)
    warned = len(re.findall(r"uploaded batch\(es\) lost with the ref server", tlog))
    assert (lost > 0) == (warned > 0)  # the metric and the log agree
    assert fig["recovery_s"] < 120


def test_worker_killed_trainer_generates_itself(server_restart_run):
    run_dir, tlog, _, fig = server_restart_run
    rows = read_rows(run_dir)
    after = [r for r in rows if r["step"] > fig["worker_killed_at_rows"] + 1]  # +1: a batch may be in the pipe
    assert fig["worker_killed_at_rows"] < ALL_STEPS, "worker killed too late to test the fallback"
    assert after and any(r["gen_s"] > 0 for r in after), [(r["step"], r["gen_s"]) for r in rows]


# --------------------------------------------------------------------------- trainer killed, then resumed
def test_trainer_sigkill_then_resume(tiny_model_dir, tmp_path):
    run_dir, tlog = tmp_path / "run", tmp_path / "trainer.log"
    with start_ref_server(tiny_model_dir, "--device", "cpu") as srv:
        args = ("--all_steps", "8", "--save_steps", "2", "--num_gen_workers", "0", "--lr", "1e-3")
        trainer = spawn(deepspeed_cmd(run_dir, srv.url, *args), tlog)
        try:
            # after the step-4 checkpoint is complete and step 5 ran: killed between checkpoints
            wait_for(lambda: (run_dir / "step_4" / "config.json").is_file() and len(rows_of(run_dir)) >= 5, 300,
                     "step 5 after the step-4 checkpoint", ((trainer, tlog),))
            kill_group(trainer)  # SIGKILL to the launcher's whole process group: launcher and both ranks
        finally:
            if trainer.poll() is None:
                kill_group(trainer)
        killed_rows = [r["step"] for r in rows_of(run_dir)]
        latest = (run_dir / "ds" / "latest").read_text().strip()
        ckpt = int(latest.removeprefix("step"))
        assert ckpt >= 4 and killed_rows[:ckpt] == list(range(1, ckpt + 1))
        proc = subprocess.run(deepspeed_cmd(run_dir, srv.url, *args, "--resume", "true"), cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"at step {ckpt}" in out and "resumed from" in out
    steps = [r["step"] for r in read_rows(run_dir)]
    print(f"\nkilled with metrics rows {killed_rows} (checkpoint {latest}); after resume: {steps}")
    assert steps == list(range(1, 9))  # nothing missing, nothing twice


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


# --------------------------------------------------------------------------- Ctrl-C to launch.sh
def run_processes(*markers: str) -> list[str]:
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.pid != me and any(m in cmd for m in markers):
            out.append(f"{p.pid}: {cmd[:200]}")
    return out


def test_launch_sh_ctrl_c_stops_everything(tmp_path):
    run_dir, port, master = tmp_path / "run", find_free_port(), find_free_port()
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--run-dir", str(run_dir), "--workers", "1", "--gpus", "2",
           "--port", str(port), "--master-port", str(master), "--", *TOY, "--Q_batch_size", "2",
           "--all_steps", "1000", "--save_steps", "1000", "--get_wait", "3"]
    log = tmp_path / "launch.log"
    with open(log, "wb") as fh:  # its own session: the SIGINT below goes to launch.sh's process only
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    markers = (f"--port {port}", f"127.0.0.1:{port}", f"--master_port {master}", f"--master_port={master}")
    try:
        wait_for(lambda: len(rows_of(run_dir)) >= 1, 300, "training under launch.sh", ((proc, log),))
        children = run_processes(*markers)
        assert len(children) >= 4, children  # server, worker, deepspeed launcher, ranks
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(90)
        seconds = time.monotonic() - t0
        wait_for(lambda: not run_processes(*markers), 20, "children gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for line in run_processes(*markers):  # never leave anything behind, even on failure
            try:
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    print(f"\nlaunch.sh: SIGINT -> exit {rc} in {seconds:.1f} s; {len(children)} processes of the run before, "
          f"{len(run_processes(*markers))} after")
    assert rc == 130, log.read_text(errors="replace")[-3000:]
    assert "stopped everything" in log.read_text(errors="replace")
    assert run_processes(*markers) == []
