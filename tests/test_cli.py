"""Every entry point reads what a user types the same way (issue 31, common/settings/argparser.py): dashes or
underscores in any option, no prefix abbreviation, errors in one line that name the close option."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from common.settings.argparser import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="prog")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--num_generations", type=int)
    p.add_argument("--ref-url")
    return p


def test_either_separator_and_equals_syntax():
    a = parser().parse_args(["--max_new_tokens", "4", "--num-generations=8", "--ref_url=--a-b_c"])
    assert (a.max_new_tokens, a.num_generations, a.ref_url) == (4, 8, "--a-b_c")  # values untouched
    a = parser().parse_args(["--max-new_tokens=5"])
    assert a.max_new_tokens == 5


@pytest.mark.parametrize("argv, message", [
    (["--num_generation", "4"], "prog: error: unknown option --num_generation (did you mean --num_generations?)"),
    (["--max-new", "4"], "prog: error: unknown option --max-new"),  # a prefix is not the option
    (["--max_new_tokens", "many"], "prog: error: argument --max-new-tokens: invalid int value: 'many'"),
    (["stray"], "prog: error: unexpected argument(s): stray"),
])
def test_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(message), err


def test_nothing_after_a_bare_double_dash_is_rewritten():
    p = ArgumentParser(prog="prog")
    p.add_argument("--ref-url")
    p.add_argument("rest", nargs="*")
    a = p.parse_args(["--ref_url", "u", "--", "--ref_url", "x"])
    assert a.ref_url == "u" and a.rest == ["--ref_url", "x"]


def test_launch_roles_demo_status_and_placement_take_both_spellings():
    from trainer.demo.cli import parse_args as demo_args
    from trainer.dist.hosts import parse as hosts_parse

    args, extra = hosts_parse(["workers", "--ref_url", "http://h:1", "--run_dir", "/tmp/x", "--first_id", "2",
                               "--", "--max-new-tokens", "8"])
    assert (args.ref_url, args.run_dir, args.first_id) == ("http://h:1", "/tmp/x", 2)
    assert extra == ["--max-new-tokens", "8"]  # the trainer's own, read by trainer/main.py
    a, _ = demo_args(["--sft_steps", "3", "--run_dir", "/tmp/d", "--eval-limit", "5"])
    assert (a.sft_steps, a.run_dir, a.eval_limit) == (3, "/tmp/d", 5)
    with pytest.raises(SystemExit):
        demo_args(["--sft", "3"])  # no abbreviation of --sft-steps / --sft-target


@pytest.mark.parametrize("cmd, want", [
    (["-m", "ref_server", "--max_queu", "3"], "unknown option --max_queu (did you mean --max_queue?)"),
    (["-m", "trainer.evaluate", "--model", "tiny", "--max_new_token", "3"],
     "unknown option --max_new_token (did you mean --max-new-tokens?)"),
    (["-m", "ref_server.status_cli", "--ref_ur", "x"], "unknown option --ref_ur (did you mean --ref-url?)"),
    (["-m", "trainer.dist.hosts", "workers", "--ref-url", "u", "--run-dir", "d", "--first", "1"],
     "unknown option --first"),
    (["-m", "common.placement.launch_plan", "--workers", "1", "--", "--num_generation", "4"],
     "unknown option --num_generation (did you mean --num_generations?)"),
])
def test_entry_points_refuse_a_near_name_in_one_line(cmd, want):
    r = subprocess.run([sys.executable, *cmd], cwd=REPO, env=subprocess_env(PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and want in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("trainer_args, want", [
    # issue 60: the command the user typed, not trainer/main.py's (launch.sh train -- --help lists the options)
    (["--bad_key", "1"], "launch.sh train --: error: unknown option --bad_key (see launch.sh train -- --help)"),
    (["--num-generation", "4"], "did you mean --num_generations?"),
    (["--beta", "-1"], "config: beta must be >= 0"),
    (["--model_init_kwargs", '{"torch_dtype": "bfloat16"}'], "model_init_kwargs may not set torch_dtype"),
])
def test_launch_train_config_errors_are_one_line(trainer_args, want, tmp_path):
    """Through launch.sh (common/placement/launch_plan.py reads the trainer's options), before anything starts."""
    r = subprocess.run(["bash", str(REPO / "launch.sh"), "train", "--ref-model", "tiny", "--print-plan", "--",
                        *trainer_args], cwd=tmp_path, env=subprocess_env(GRPO_PYTHON=sys.executable,
                                                                         PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and want in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("port", ["0", "70000", "abc"])
def test_a_port_the_clients_cannot_reach_is_refused(tmp_path, port):
    """`--port 0` passed the port check ("0 is free") and then launch.sh waited for http://127.0.0.1:0/health
    until its 300 tries ran out: the server binds a random port nobody else learns. Refused before anything runs."""
    r = subprocess.run(["bash", str(REPO / "launch.sh"), "train", "--port", port, "--", "--model", "tiny"],
                       cwd=tmp_path, env=subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and f"--port '{port}'" in r.stderr.splitlines()[-1], r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()


def test_skip_checks_is_for_train_only(tmp_path):
    """`launch.sh check --skip-checks` would check nothing: refused in one line (--skip-checks is train's option)."""
    r = subprocess.run(["bash", str(REPO / "launch.sh"), "check", "--skip-checks", "--", "--model", "tiny"],
                       cwd=tmp_path, env=subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "--skip-checks is for train" in r.stderr.splitlines()[-1], r.stdout + r.stderr
    assert "--skip-checks" in subprocess.run(["bash", str(REPO / "launch.sh"), "--help"], capture_output=True,
                                             text=True, timeout=60).stdout
