"""Your own code from your own folder (issue 31, item 1): common/user_code.py loads 'module:name' and
'path/to/file.py:name' from the folder launch.sh ran in (GRPO_USER_DIR) in every process.

Before: launch.sh changed into the checkout and the editable install maps only common/trainer/ref_server, so a
reward module in the user's folder (or examples/ in the checkout) was importable by no rank and no worker; with
PYTHONPATH unset the README's own bring-your-own command exited 1 with "No module named 'examples'".
"""
from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, find_free_port, run_process_group, subprocess_env

from common.user_code import USER_DIR_ENV, load_object
from trainer.rewards.registry import load_reward_fns

REWARD_FILE = '''
from helper_mod import DIGITS  # a neighbour of this file, imported the way a user's file would


def digits(completion: str, ground_truth: str) -> float:
    """Share of digit characters: a random tiny model scores above 0 on it."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c in DIGITS for c in chars) / len(chars) if chars else 0.0
'''


JUDGE_FILE = '''
"""An LLM judge's shape: a module-level httpx.AsyncClient, bound to the event loop of its first request, asking a
local endpoint (a thread of this process) for a score."""
import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class Endpoint(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client's pool keeps the connection, bound to its loop

    def do_POST(self):
        text = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        body = str(min(len(text), 10) / 10).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # a call's requests arrive at once (gathered); the default backlog of 5 resets some
    daemon_threads = True


SERVER = Server(("127.0.0.1", 0), Endpoint)
threading.Thread(target=SERVER.serve_forever, daemon=True).start()
CLIENT = httpx.AsyncClient(base_url=f"http://127.0.0.1:{SERVER.server_port}")
CALLS = [0]


async def judge(prompts, completions, log_metric, **kwargs):
    CALLS[0] += 1
    log_metric("judge_calls", float(CALLS[0]))  # this process's calls so far: a second one worked
    answers = await asyncio.gather(*(CLIENT.post("/score", content=c.encode()) for c in completions))
    return [float(a.text) for a in answers]
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder outside the checkout: a module, a file in a subfolder with a neighbour it imports."""
    (tmp_path / "my_rewards.py").write_text("def short(completion, ground_truth):\n"
                                            "    return 1.0 / (1 + len(completion))\n"
                                            "def flat(completion, ground_truth):\n"
                                            "    return 1.0\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "extra_rewards.py").write_text(REWARD_FILE)
    (tmp_path / "lib" / "helper_mod.py").write_text("DIGITS = '0123456789'\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "json.py").write_text("SHADOW = True\n")  # must not shadow the standard library
    (tmp_path / "judge.py").write_text(JUDGE_FILE)
    monkeypatch.setenv(USER_DIR_ENV, str(tmp_path))
    monkeypatch.chdir(REPO)  # as launch.sh does: the process runs in the checkout, not in the user's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


def test_module_and_file_specs_load_from_the_user_folder(user_dir):
    short = load_object("my_rewards:short")
    assert short("ab", "") == pytest.approx(1 / 3)
    digits = load_object("lib/extra_rewards.py:digits")
    assert digits("a1", "") == 0.5
    assert load_object(str(user_dir / "lib" / "extra_rewards.py") + ":digits") is digits  # absolute: same module
    assert load_object("examples.byo.my_rewards:accuracy").__name__ == "accuracy"  # the checkout's examples/
    fns = load_reward_fns("my_rewards:short,lib/extra_rewards.py:digits,format")
    assert [f.__name__ for f in fns] == ["short", "digits", "reward_format"]
    import json
    assert not hasattr(json, "SHADOW") and str(user_dir) not in sys.path[:1]


@pytest.mark.parametrize("spec, msg", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("lib/missing.py:fn", "no file"),
    ("lib/extra_rewards.py:nope", "has no callable 'nope'"),
    ("broken:fn", "importing module 'broken' failed: RuntimeError: boom at import"),
    ("broken.py:fn", "RuntimeError: boom at import"),
    ("my_rewards", "unknown reward function"),
    ("my_rewards:", "names no object"),
])
def test_errors_are_one_line_and_name_the_problem(user_dir, spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        load_reward_fns(spec)
    assert "\n" not in str(e.value)
    if "cannot import" in msg:
        assert str(user_dir) in str(e.value)  # where it looked


TRL_CONFIG = {  # TRL GRPOConfig names (issue 31's done-when: a TRL-named config)
    "num_generations": 8, "max_completion_length": 8, "learning_rate": 1e-4, "max_steps": 3, "temperature": 1.0,
    "gradient_accumulation_steps": 1, "lr_scheduler_type": "linear", "log_completions": True,
    "num_completions_to_print": 2, "report_to": "tensorboard", "eval_steps": 2, "seed": 1, "logging_steps": 1,
    "bf16": False, "save_steps": 100}
TRL_DEFAULTS = REPO / "configs" / "trl_defaults.json"


@pytest.mark.slow
def test_your_own_folder_end_to_end_with_no_pythonpath(user_dir, tmp_path):
    """The path a TRL user walks on day one (issue 31), from a folder outside the checkout with PYTHONPATH unset:
    a prompt-only .json dataset (and held-out eval rows), a reward module and a reward file of that folder, a
    config in TRL's names; `./launch.sh check` passes on the same arguments, then `launch.sh train` runs with one
    genonly worker. get_wait is long, so the ranks never generate for themselves: every trained batch came from the
    worker (its reward process loaded the user's rewards too). The run shows what it trained on: completions.jsonl
    (log_completions) and an eval scored with the user's rewards.

    The config is configs/trl_defaults.json (TRL 1.16's defaults) with the user's changes on top, as a TRL user
    starts from it: issue 40's done-when, that a text prompt reaches the model as TRL sends it (no chat template,
    no system prompt: completions.jsonl's `prompt` is the user's text exactly), is checked on the same run. And
    issue 60's: the trained reward never spreads (reward_weights put all the weight on `flat`, always 1.0): TRL
    trains every group, and so does trl_defaults.json (train_zero_spread true): every step trains, nothing skipped.

    Issue 60's other done-when on the same run: an async judge keeping a module-level httpx.AsyncClient (bound to the
    loop of its first request) across calls scores every row of `check` and trains 3 steps with the worker: one
    persistent event loop per process, as TRL runs async rewards (a loop per call failed on the second)."""
    prompts = [f"Write the number {n} in digits." for n in range(20)]
    (user_dir / "train.json").write_text(json.dumps([{"prompt": p} for p in prompts]))
    (user_dir / "eval.json").write_text(json.dumps([{"prompt": f"Count to {n}."} for n in range(4)]))
    (user_dir / "trl_config.json").write_text(json.dumps({**json.loads(TRL_DEFAULTS.read_text()), **TRL_CONFIG}))
    run_dir = tmp_path / "run"
    env = subprocess_env()
    for k in ("PYTHONPATH", USER_DIR_ENV):
        env.pop(k, None)
    args = ["--model", "tiny", "--data", "train.json", "--eval_data", "eval.json",
            "--Q_batch_size", "2", "--reward_fns",
            "my_rewards:short,lib/extra_rewards.py:digits,judge.py:judge,my_rewards:flat",
            "--reward_weights", "[0,0,0,1]", "--reward_timeout", "5", "--get_wait", "240", "--eval_limit", "4",
            "--eval_max_new_tokens", "8"]
    launch = ["bash", str(REPO / "launch.sh")]
    check = run_process_group([*launch, "check", "--config", "trl_config.json", "--port", str(find_free_port()), "--",
                              *args], cwd=user_dir, env=env, timeout=300)
    assert check.returncode == 0 and "check: all passed" in check.stdout, check.stdout + check.stderr
    # --skip-checks: the same checks on the same arguments just passed above (`check`); train would run them again
    cmd = [*launch, "train", "--skip-checks", "--config", "trl_config.json", "--run-dir", "run", "--workers", "1",
           "--gpus", "2", "--port", str(find_free_port()), "--", *args]
    proc = run_process_group(cmd, cwd=user_dir, env=env, timeout=600)
    logs = {n: (run_dir / n).read_text() for n in ("trainer.log", "worker0.log") if (run_dir / n).is_file()}
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(v[-2000:] for v in logs.values())
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["num_pre_Q"] == 8 and cfg["all_steps"] == 3 and cfg["lr_schedule"] == "linear", cfg
    assert cfg["prompt_format"] == "trl" and cfg["use_bias_correction_kl"] is True, cfg  # trl_defaults.json's
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["batches_from_ranks"] == 0 and r["batches_from_workers"] == 2, r  # 2 ranks x 1 batch, all worker's
        assert "reward/short" in r and "reward/digits" in r and "reward/judge" in r
        assert r["skipped_groups"] == 0 and r["reward_std"] == 0.0, r  # no spread, trained all the same (as TRL)
    # the worker's reward process called the judge once per round (both groups at once), every call on one loop
    assert max(r.get("judge_calls", 0) for r in rows) >= 3, rows
    assert "Traceback" not in "".join(logs.values())
    # log_completions: every trained completion (3 steps x 2 ranks x 8), the worker's, scored by the user's rewards
    done = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in done] == [1] * 16 + [2] * 16 + [3] * 16
    assert all(set(r["rewards"]) == {"short", "digits", "judge", "flat"} and r["producer"].startswith("worker")
               for r in done), done[0]
    assert all(r["rewards"]["judge"] is not None for r in done)  # scored, not timed out
    assert {r["advantage"] for r in done} == {0.0} and {r["reward"] for r in done} == {1.0}
    assert all(r["prompt"] in prompts for r in done), done[0]["prompt"]  # the user's text, exactly (TRL's)
    assert "completions trained at step 2 (2 of 16" in logs["trainer.log"]
    # in-training eval on the held-out rows, scored with the run's own rewards: no correctness reward, no accuracy
    assert {"eval_reward/short", "eval_reward/digits", "eval_reward/flat", "eval_reward_mean"} <= set(rows[1]), rows[1]
    assert "eval_accuracy" not in rows[1] and rows[1]["eval_n"] == 4
