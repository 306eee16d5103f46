"""A worker sharing a GPU with trainer ranks builds its engine only once the ranks are ready (issue 30): vLLM's
memory profiling fails when another process on its GPU frees memory meanwhile, as a rank does while it
initialises. On CPU the handshake is what can be tested, with the real processes: a genonly worker told to wait
(--wait_for_ranks, what launch.sh's plan passes to a worker on a rank's GPU) and a real DeepSpeed rank.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, find_free_port, subprocess_env

WORKER = ["--model", "tiny", "--data", "arith", "--system_prompt", "", "--reward_fns", "toy_rewards:digit_fraction",
          "--max_new_tokens", "4", "--num_pre_Q", "4", "--Q_batch_size", "1", "--temperature", "1.0",
          "--heartbeat_s", "1", "--train_zero_spread", "true"]


def env() -> dict:
    return subprocess_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}",
                          PATH=f"{REPO / '.venv' / 'bin'}:{subprocess_env()['PATH']}")


def start_worker(url: str, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as f:  # a file, not a pipe: a full pipe would block it
        return subprocess.Popen([sys.executable, "trainer/main.py", "genonly", *WORKER, "--ref_server", url,
                                 "--output_dir", str(log.parent), *args], cwd=REPO, env=env(), stdout=f,
                                stderr=subprocess.STDOUT)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_ready_ranks_are_those_with_a_recent_heartbeat():
    from trainer.worker import ready_ranks
    rows = [{"id": "trainer-rank1", "role": "rank", "last_heartbeat_ago_s": 0.5, "state": "training step 3"},
            {"id": "trainer-rank0", "role": "rank", "last_heartbeat_ago_s": 2.0, "state": "starting"},
            {"id": "trainer-rank2", "role": "rank", "last_heartbeat_ago_s": None, "state": ""},  # a /get only
            {"id": "trainer-rank3", "role": "rank", "last_heartbeat_ago_s": 300.0, "state": "x"},  # an old attempt
            {"id": "trainer-rank4", "role": "rank", "last_heartbeat_ago_s": 1.0, "state": "done"},
            {"id": "worker0", "role": "worker", "last_heartbeat_ago_s": 0.1, "state": "generating"}]
    assert ready_ranks({"participants": rows}, fresh_s=25) == ["trainer-rank0", "trainer-rank1"]


@pytest.mark.multiproc  # a ref server and a genonly worker process
def test_a_worker_waiting_for_ranks_that_never_come_fails_loudly(start_server, tiny_model_dir, tmp_path):
    log = tmp_path / "worker0.log"
    with start_server(tiny_model_dir) as srv:
        t0 = time.monotonic()
        proc = start_worker(srv.url, log, "--wait_for_ranks", "2", "--wait_for_ranks_timeout", "4",
                            "--gen_backend", "vllm")
        assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
        text = log.read_text()
        assert "2 trainer rank(s) not ready after 4 s (ready so far: none)" in text and "wait_for_ranks_timeout" in text
        assert "generation engine: " not in text and "Traceback" not in text  # the engine was never started
        assert time.monotonic() - t0 < 120
        row = next(r for r in requests.get(srv.url + "/status", timeout=10).json()["participants"]
                   if r["id"] == "worker0")
        assert "waiting for 2 trainer rank(s)" in row["state"]  # in the status table meanwhile


@pytest.mark.slow
def test_the_worker_builds_its_engine_only_after_the_rank_is_ready(start_server, tiny_model_dir, tmp_path):
    """The worker starts first and waits; the real rank comes up (engine built, first weights published, first
    heartbeat); only then does the worker build its engine, and the rank trains on the worker's batch."""
    log = tmp_path / "worker0.log"
    with start_server(tiny_model_dir) as srv:
        worker = start_worker(srv.url, log, "--wait_for_ranks", "1", "--worker_rounds", "2")
        wait_for(lambda: "waiting for 1 trainer rank(s)" in log.read_text(), 120, "wait", worker, log)
        time.sleep(3)
        assert worker.poll() is None and "generation engine: " not in log.read_text()  # no rank: still waiting

        def rank_ready() -> bool:
            from trainer.worker import ready_ranks
            return bool(ready_ranks(requests.get(srv.url + "/status", timeout=10).json(), fresh_s=60))

        assert not rank_ready()
        with open(tmp_path / "trainer.log", "wb") as f:
            rank = subprocess.Popen(
                [str(REPO / ".venv" / "bin" / "deepspeed"), "--num_gpus", "1", "--master_port", str(find_free_port()),
                 "trainer/main.py", *WORKER, "--ref_server", srv.url, "--output_dir", str(tmp_path / "run"),
                 "--num_gen_workers", "1", "--get_wait", "300", "--all_steps", "1"],
                cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            seen_ready = False
            deadline = time.monotonic() + 400
            while "generation engine: " not in log.read_text():  # the log first, then the server: no false alarm
                seen_ready = seen_ready or rank_ready()
                assert worker.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            assert seen_ready or rank_ready(), "the worker built its engine before the rank was ready"
            assert rank.wait(timeout=400) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        finally:
            if rank.poll() is None:
                rank.kill()
        worker.terminate()
        worker.wait(timeout=60)
    text = log.read_text()
    assert text.index("trainer rank(s) ready after") < text.index("generation engine: ")
    assert "trainer-rank0" in text
    trained = (tmp_path / "trainer.log").read_text()
    assert "training done: 1 steps" in trained
    assert re.search(r"worker done: \d+ rounds, [1-9]\d* batches uploaded", text), text[-2000:]  # it fed the rank
