"""`./launch.sh check` finds in seconds what would fail in minutes, and a process that dies is never silent (issue 31,
items 2 and 3). Everything runs as a user runs it: launch.sh from a folder outside the checkout, no PYTHONPATH.

Before: there was no `check` mode; a missing reward module surfaced as a crashed worker and ranks that filled in for
it (the run exited 0); `launch.sh train` waited on DeepSpeed alone, so a genonly worker that died left only a
silent producer in /status.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests
from conftest import REPO, find_free_port, subprocess_env
from conftest import launch_as_user as launch

from trainer.dist.exits import mark_exited
from trainer.dist.hosts import watch

# a reward that kills the genonly worker (argv "genonly"; reward_timeout 0 runs rewards in-process) and pays digits
# everywhere else: the ranks, and launch.sh's own check of the reward
DEADLY = '''import os, sys


def digits(completion, ground_truth):
    if "genonly" in sys.argv:
        os._exit(7)
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
'''
BASE = ["--model", "tiny", "--data", "arith", "--system_prompt", "", "--max_new_tokens", "8", "--num_pre_Q", "8",
        "--temperature", "1.0", "--save_steps", "100"]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def short(completion, ground_truth):\n"
                                            "    return 1.0 / (1 + len(completion))\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "2+2", "ground_truth": "4"}\n'
                                          '{"prompt": "3+3", "ground_truth": "6"}\n')
    return tmp_path


def test_check_passes_on_a_good_run_and_names_each_problem(folder, check_in):
    """The good run through launch.sh as the user runs it; the three bad ones through trainer.check itself (what
    `launch.sh check` execs, in the folder with its GRPO_USER_DIR): each launch.sh call costs a torch +
    transformers import (~5 CPU-s) and these test the checks' lines, not launch.sh."""
    t0 = time.time()
    ok = launch(folder, "check", "--port", str(find_free_port()), "--", *BASE,
                "--data", "train.jsonl", "--reward_fns", "my_rewards:short,format")
    seconds = time.time() - t0
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name in ("config", "model", "data", "rewards", "port", "disk"):
        assert any(line.startswith(f"ok   {name}") for line in ok.stdout.splitlines()), (name, ok.stdout)
    assert "| <|im_start|>user" in ok.stdout and "2+2" in ok.stdout  # the prompt as the model sees it
    assert "short=" in ok.stdout and "ref_server:" not in ok.stdout  # scored; the plan is printed, not started
    print(f"launch.sh check: {seconds:.1f} s")
    bad = {"rewards": (["--reward_fns", "no_such_rewards:fn"], "cannot import module 'no_such_rewards'"),
           "model": (["--model", "missing_model_dir/"], "missing_model_dir"),
           "data": (["--data", "missing.jsonl"], "missing.jsonl")}
    for name, (args, words) in bad.items():
        code, out, _ = check_in(folder, "--port", str(find_free_port()), "--", *BASE, "--data", "train.jsonl", *args)
        fails = [line for line in out.splitlines() if line.startswith("FAIL")]
        assert code != 0 and len(fails) == 1, (name, out)
        assert fails[0].startswith(f"FAIL {name}") and words in fails[0], fails
    # issue 60: every row is read (it read 3 and passed a file whose row 8 has no prompt), and it says how many
    assert "2 rows read" in ok.stdout, ok.stdout
    rows = [f'{{"prompt": "{n}+{n}", "ground_truth": "{2 * n}"}}' for n in range(10)]
    rows[7] = '{"question_x": "8+8", "ground_truth": "16"}'
    (folder / "bad_row.jsonl").write_text("\n".join(rows) + "\n")
    code, out, _ = check_in(folder, "--port", str(find_free_port()), "--", *BASE, "--data", "bad_row.jsonl")
    assert code != 0 and any(line.startswith("FAIL data") and "bad_row.jsonl:8:" in line
                             for line in out.splitlines()), out


def test_check_refuses_a_taken_port_and_train_runs_the_checks_first(folder, check_in):
    """The port check through trainer.check itself (what `launch.sh check` execs); `train` through launch.sh."""
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, _ = check_in(folder, "--port", str(port), "--", *BASE)
        line = next(x for x in out.splitlines() if x.startswith("FAIL port"))
        assert code != 0 and f"port {port} is taken" in line and "--port" in line, out
    run_dir = folder / "run"
    proc = launch(folder, "train", "--run-dir", "run", "--port", str(find_free_port()), "--", *BASE,
                  "--reward_fns", "no_such_rewards:fn")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[check] FAIL rewards" in proc.stderr and "nothing was started" in proc.stderr
    assert not (run_dir / "ref_server.log").exists() and not (run_dir / "trainer.log").exists()


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_run_unless_keep_going(folder):
    (folder / "deadly.py").write_text(DEADLY)
    args = [*BASE, "--reward_fns", "deadly:digits", "--reward_timeout", "0", "--get_wait", "2", "--Q_batch_size", "1"]
    run = folder / "run"
    t0 = time.time()
    # --skip-checks: what is tested is the run's supervision, not the checks (the tests above)
    proc = launch(folder, "train", "--skip-checks", "--run-dir", "run", "--port", str(find_free_port()), "--", *args,
                  "--all_steps", "50")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "worker0 exited with code 7 while the trainer was running" in proc.stderr
    assert "last lines of" in proc.stderr and "run failed (exit 3): worker0 exited with code 7" in proc.stderr
    assert "training done" not in (run / "trainer.log").read_text()  # the run ended: it did not go on for 50 steps
    print(f"dead worker noticed, run ended in {time.time() - t0:.0f} s")

    going = launch(folder, "train", "--skip-checks", "--run-dir", "run2", "--keep-going", "--port",
                   str(find_free_port()), "--", *args, "--all_steps", "2")
    assert going.returncode == 0, going.stderr[-3000:]
    assert "!!! --keep-going: the run goes on WITHOUT worker0" in going.stderr
    assert "training done: 2 steps" in (folder / "run2" / "trainer.log").read_text()


def test_keep_going_marks_the_exited_worker_in_status(tiny_model_dir, start_server):
    with start_server(tiny_model_dir) as srv:
        state = mark_exited(srv.url, "worker3", 7)
        rows = {r["id"]: r for r in requests.get(srv.url + "/status", timeout=10).json()["participants"]}
        assert rows["worker3"]["state"] == state and "exited with code 7" in state
        table = subprocess.run([sys.executable, "-m", "ref_server.status_cli", "--ref-url", srv.url], cwd=REPO,
                               env=subprocess_env(), capture_output=True, text=True, timeout=60).stdout
        assert "exited with code 7" in table


def test_worker_host_watch_names_the_failed_worker_and_stops_the_others(tmp_path, capsys):
    """The `workers` host role (trainer/dist/hosts.py): the first worker that fails stops the rest (exit 3)."""
    (tmp_path / "worker1.log").write_text("loading...\nValueError: no such reward\n")
    procs = {"worker0": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
             "worker1": subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])}
    stopped = []

    def stop(_sig, _frame):
        stopped.append(True)
        procs["worker0"].terminate()

    assert watch(procs, tmp_path, "http://127.0.0.1:9", keep_going=False, stop=stop) == 3
    err = capsys.readouterr().err
    assert "worker1 exited with code 7" in err and "ValueError: no such reward" in err and stopped
