"""The first hour of a new user (issue 41), run as they run it: launch.sh from a folder outside the checkout, no
PYTHONPATH (a check's own line: trainer.check in that folder, which is what `launch.sh check` execs). --help through
launch.sh, the docs' python commands, a port in TIME-WAIT, a reward that raises, a prompt the tools push past
max_prompt_length.

Before: `launch.sh train -- --help` exited 127 (the help was taken for the model name and eval'ed); `check` bound
0.0.0.0 without SO_REUSEADDR and called a port in TIME-WAIT taken."""
from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest
from conftest import REPO, find_free_port, user_env
from conftest import launch_as_user as launch

BASE = ["--model", "tiny", "--data", "arith", "--system_prompt", "", "--max_new_tokens", "8", "--num_pre_Q", "4",
        "--temperature", "1.0", "--save_steps", "100"]


def test_help_through_launch_sh_and_the_docs_python_commands(tmp_path):
    for mode in ("train", "check"):
        proc = launch(tmp_path, mode, "--", "--help", timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "--num_generations" in proc.stdout and "usage:" in proc.stdout, proc.stdout[-2000:]
    # the entry point finds the project from any folder (trainer/ on sys.path is replaced by the checkout)
    main = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "trainer" / "main.py"), "--help"],
                          cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=120)
    assert main.returncode == 0 and "--num_generations" in main.stdout, main.stderr[-2000:]
    # every `python ...` command the docs write goes through the project's venv (bare `python` has no torch;
    # `launch.sh python my_train.py` is the venv's python)
    bare = []
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for m in re.finditer(r"(?<![\w/.-])(?<!launch\.sh )python3? (-m \S+|\S+\.py)", page.read_text()):
            bare.append(f"{page.name}: {m.group(0)}")
    allowed = ("benchmarks.md",)  # the bench rows: bench/*.py put the checkout on sys.path themselves
    assert [b for b in bare if not b.startswith(allowed)] == []


def _time_wait_port() -> int:
    """A port whose server just closed a connection first: its side is left in TIME-WAIT for a minute."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the ref server binds
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server closes first: TIME-WAIT on its side (127.0.0.1:port)
    time.sleep(0.2)
    cli.close()
    srv.close()
    ss = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
    assert "TIME-WAIT" in ss, ss
    return port


def test_check_passes_on_a_port_in_time_wait(tmp_path, check_in):
    port = _time_wait_port()
    code, out, _ = check_in(tmp_path, "--port", str(port), "--", *BASE)
    assert code == 0, out
    assert f"ok   port     {port} on 127.0.0.1 is free" in out, out


PICKY = '''def picky(completion, ground_truth):
    if ground_truth == "8":
        raise ValueError("cannot score the answer 8")
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
'''


def _rows(*answers: int) -> str:
    return "".join(f'{{"prompt": "{a // 2} + {a - a // 2} = ?", "ground_truth": "{a}"}}\n' for a in answers)


@pytest.mark.slow  # a launch.sh train run
def test_a_reward_that_raises_on_one_row_is_the_last_line(tmp_path, check_in, checks_pass):
    """check scores whole groups of the first rows: it names the function, the row and ValueError. Past the rows
    check reads, training meets it: the run ends within 120 s, its last line naming the function and ValueError
    (before: `worker0 exited with code 1: <the completion's text>`)."""
    (tmp_path / "my_rewards.py").write_text(PICKY)
    (tmp_path / "early.jsonl").write_text(_rows(2, 8, 4, 6))
    (tmp_path / "late.jsonl").write_text(_rows(2, 4, 6, 8))
    args = [*BASE, "--reward_fns", "my_rewards:picky", "--get_wait", "2"]
    code, out, _ = check_in(tmp_path, "--port", str(find_free_port()), "--", *args, "--data",
                         "early.jsonl")
    fail = next(x for x in out.splitlines() if x.startswith("FAIL"))
    assert code != 0 and fail.startswith("FAIL rewards"), out
    assert "'picky' failed on row 1 (columns: prompt, ground_truth): ValueError: cannot score" in fail, fail
    # late.jsonl's first rows score: check passes (here, in this process), and train skips the same checks
    port = find_free_port()
    skip = checks_pass(tmp_path, "--run-dir", "run", "--port", str(port), "--", *args, "--data", "late.jsonl",
                       "--all_steps", "50")
    t0 = time.time()
    proc = launch(tmp_path, "train", *skip, "--run-dir", "run", "--port", str(port), "--", *args,
                  "--data", "late.jsonl", "--all_steps", "50", timeout=400)
    seconds = time.time() - t0
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and seconds < 120, (seconds, proc.stderr[-3000:])
    assert "run failed" in last and "'picky' failed on row 3" in last and "ValueError" in last, last
    assert "columns: prompt, ground_truth" in last and "8 = ?" not in last, last  # the row's text is not the cause
    print(f"reward error ended the run in {seconds:.0f} s: {last}")


def test_check_counts_the_tools_section_against_max_prompt_length(tmp_path, check_in):
    """The arith prompt alone fits 100 tokens; with the calculator's schema rendered by the chat template it does
    not (before: check passed, and every prompt was skipped until stall_timeout)."""
    code, out, _ = check_in(tmp_path, "--port", str(find_free_port()), "--", *BASE, "--tools",
                         "calculator", "--max_prompt_length", "100")
    fail = next(x for x in out.splitlines() if x.startswith("FAIL"))
    assert code != 0 and fail.startswith("FAIL data") and "max_prompt_length 100" in fail, out
    assert "tools section" in fail, fail


def _stats(groups: int, components: dict, skipped_long: int = 0):
    from trainer.rollout import RolloutStats
    n = len(next(iter(components.values()))) if components else 0
    total = [sum(v[k] or 0.0 for v in components.values()) for k in range(n)]
    return RolloutStats(groups=groups, skipped_no_spread=groups, skipped_long_prompt=skipped_long, rewards=total,
                        components=components)


def test_nothing_spins_and_none_is_shown_as_none(caplog):
    from trainer.run.stall import NothingToTrain, StallReporter
    now = [0.0]
    # None (no reward applied) is None in the stall line, not 0 (before: `rewards seen {0: 84}`)
    rep = StallReporter("worker0", every=30.0, clock=lambda: now[0])
    rep.add(_stats(2, {"exact": [None] * 8}), produced=0)
    rep.add(_stats(1, {"exact": [0.0] * 4}), produced=0)
    now[0] += 31.0
    msg = rep.maybe_log()
    assert "rewards seen {None: 8, 0: 4}" in msg, msg
    # the first groups: a reward None everywhere beside one that applies is a warning, the run goes on
    rep = StallReporter("worker0", none_reward_groups=4)
    with caplog.at_level("WARNING", logger="trainer"):
        for _ in range(2):
            rep.add(_stats(2, {"exact": [None] * 8, "format": [1.0, 0.0] * 4}), produced=2)
    assert "reward 'exact' returned None" in caplog.text
    # ... and alone, it ends the run naming it, once the first none_reward_groups groups are in
    rep = StallReporter("worker0", none_reward_groups=4)
    rep.add(_stats(3, {"exact": [None] * 12}), produced=0)
    with pytest.raises(NothingToTrain, match=r"worker0: every reward returned None .* first 4 groups: exact"):
        rep.add(_stats(1, {"exact": [None] * 4}), produced=0)
    # prompts skipped for length: max_skipped_prompts in a row end it naming max_prompt_length; a group between resets
    rep = StallReporter("rank 1", max_skipped_prompts=3, max_prompt_length=100)
    rep.add(_stats(0, {}, skipped_long=2), produced=0)
    rep.add(_stats(1, {"exact": [1.0, 0.0]}), produced=1)
    rep.add(_stats(0, {}, skipped_long=2), produced=0)
    with pytest.raises(NothingToTrain, match=r"rank 1: the last 3 prompts .* max_prompt_length 100"):
        rep.add(_stats(0, {}, skipped_long=1), produced=0)


@pytest.mark.slow  # a launch.sh train run, stopped as it starts
def test_ctrl_c_before_any_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    """Issue 60: a Ctrl-C before the first checkpoint printed the --resume command, which found no checkpoint and
    silently started again from step 0: the last line now says there is nothing to resume."""
    import signal
    port = find_free_port()
    proc = subprocess.Popen(["bash", str(REPO / "launch.sh"), "train", "--skip-checks", "--run-dir", "r", "--port",
                             str(port), "--", *BASE], cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (tmp_path / "r" / "ref_server.log").is_file():
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "interrupted before the first checkpoint" in line and "nothing to resume" in line, err[-3000:]
    assert "--resume true" not in err


# output_dir after -- (no --run-dir), the checkpoints a cut save leaves, and `launch.sh status` once the run is over:
# tests/test_e2e.py's shared run, as a user runs it (test_cut_saves_are_removed_and_status_says_how_the_run_ended).


@pytest.mark.slow  # a launch.sh train run
def test_ctrl_c_stops_everything_and_prints_the_exact_resume_command(tmp_path):
    """Ctrl-C to launch.sh mid-run: exit 130, every process of the run gone, and the last line the command that
    resumes it."""
    import os
    import signal

    from test_e2e import leftover_processes

    def run_processes(*markers: str) -> list[str]:
        return sorted({p for m in markers for p in leftover_processes(m)})
    args = [*BASE, "--all_steps", "50", "--save_steps", "1", "--get_wait", "2"]
    # SIGINT at its default disposition, as a terminal's Ctrl-C finds it: a suite started in the background of a
    # non-interactive shell (nohup ... &) inherits SIGINT ignored, and bash cannot trap a signal ignored on entry
    # (then the run went on to its end and this timed out; test_faults.py does the same)
    port = find_free_port()
    proc = subprocess.Popen(["bash", str(REPO / "launch.sh"), "train", "--run-dir", "r", "--port",
                             str(port), "--", *args], cwd=tmp_path, env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = tmp_path / "r" / "ds" / "latest"  # a checkpoint to resume from (before it: nothing to resume)
    markers = (f"--port {port}", f"127.0.0.1:{port}", str(tmp_path / "r"))  # server, worker, launcher, ranks
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (latest.is_file() and latest.read_text().strip()):
            time.sleep(1)
        children = run_processes(*markers)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        seconds = time.monotonic() - t0
        gone = time.monotonic() + 20
        while run_processes(*markers) and time.monotonic() < gone:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in run_processes(*markers):  # never leave anything behind, even on failure
            try:
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    print(f"\nlaunch.sh: SIGINT -> exit {proc.returncode} in {seconds:.1f} s; {len(children)} processes of the run "
          f"before, {len(run_processes(*markers))} after")
    assert proc.returncode == 130, err[-3000:]
    # every child stopped (before: tests/test_faults.py's own run), said on the way out
    assert "stopped everything" in err and run_processes(*markers) == [], err[-3000:]
    line = err.strip().splitlines()[-1]  # the last line says how to go on
    assert "to continue this run" in line, err[-3000:]
    cmd = line.split("from its last checkpoint: ", 1)[1]
    assert cmd.startswith(f"cd {tmp_path} && {REPO / 'launch.sh'} train --port ") and "--run-dir " in cmd, cmd
    assert f"--run-dir {tmp_path / 'r'} -- " in cmd and cmd.endswith("--get_wait 2 --resume true"), cmd
    latest = (tmp_path / "r" / "ds" / "latest").read_text().strip() if (tmp_path / "r" / "ds" / "latest").is_file() \
        else "step0"
    tags = [int(p.name[4:]) for p in (tmp_path / "r" / "ds").glob("step*")] if (tmp_path / "r" / "ds").is_dir() else []
    assert all(t <= int(latest[4:]) for t in tags), (latest, tags)  # nothing newer than `latest` left
    assert not list((tmp_path / "r").glob("*.partial"))


def test_evaluate_split_and_the_configured_rewards(tmp_path):
    """--split defaults to none: on a single file it is an error naming eval_data (before: every row, the training
    rows too, reported as `split: test`); a dataset with splits needs one; the run's config's rewards score the
    completions (before: the built-in correct/format, whatever the run used)."""
    (tmp_path / "my_rewards.py").write_text("def short(completion, ground_truth):\n"
                                            "    return 1.0 / (1 + len(completion))\n")
    (tmp_path / "held_out.jsonl").write_text(_rows(2, 4))
    # issue 60: the config's generation settings too (max_completion_length was ignored: 512 tokens a row)
    (tmp_path / "cfg.json").write_text('{"reward_fns": ["my_rewards:short"], "max_completion_length": 3, '
                                       '"system_prompt": ""}')
    py = [str(REPO / ".venv" / "bin" / "python"), "-m", "trainer.evaluate", "--model", "tiny"]
    run = lambda *a: subprocess.run([*py, *a], cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                                    timeout=300)
    bad = run("--data", "held_out.jsonl", "--split", "test")
    assert bad.returncode == 2 and "single file" in bad.stderr and "eval_data" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    need = run("--data", "arith")
    assert need.returncode == 2 and "--split" in need.stderr, need.stderr
    ok = run("--data", "held_out.jsonl", "--config", "cfg.json", "--out", "e.json")
    assert ok.returncode == 0, ok.stderr[-3000:]
    res = __import__("json").loads((tmp_path / "e.json").read_text())
    assert res["split"] is None and res["n"] == 2 and res["reward_fns"] == ["short"], res
    assert (res["max_new_tokens"], res["system_prompt"], res["prompt_format"]) == (3, "", "auto"), res
    assert res["rewards"]["short"][1] == 2 and "reward/short" in res and res["accuracy"] is None, res
    assert "accuracy n/a" in ok.stdout and "reward/short" in ok.stdout, ok.stdout
