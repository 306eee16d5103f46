"""Prompt-only conversational data end to end (issue 31, section 4): a `.json` array of message-list prompts with no
answer column (no --prompt_format), TRL's length reward, and held-out eval_data, through `launch.sh train` on the
tiny model: real ref server, one genonly worker, one DeepSpeed CPU rank. The ground truth None reaches the rewards
in the worker and the rank (through their reward processes); `correct` on the same data is refused at start, in one
line naming the reward and the data."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import REPO, find_free_port, subprocess_env

pytestmark = pytest.mark.slow


def launch(tmp_path, name: str, args: list[str], checks_pass=None) -> tuple[subprocess.CompletedProcess, str]:
    """`launch.sh train`; with `checks_pass` (tests/conftest.py) the checks run here first."""
    run_dir, port = tmp_path / name, find_free_port()
    skip = checks_pass(REPO, "--run-dir", str(run_dir), "--port", str(port), "--", *args) if checks_pass else []
    env = subprocess_env(PYTHONPATH=f"{REPO / 'tests'}:{REPO}",
                         PATH=f"{REPO / '.venv' / 'bin'}:{subprocess_env()['PATH']}")
    cmd = ["bash", str(REPO / "launch.sh"), "train", *skip, "--run-dir", str(run_dir), "--workers", "1", "--gpus",
           "1", "--port", str(port), "--", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a timeout ends every child
    try:
        out, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    logs = "".join((run_dir / n).read_text() for n in ("trainer.log", "worker0.log") if (run_dir / n).is_file())
    return proc, logs


def test_prompt_only_conversational_json_with_eval_data(tmp_path, checks_pass):
    prompts = [[{"role": "user", "content": f"Say something about {w}."}] for w in ("cats", "rain", "tea", "maps")]
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": p, "id": i} for i, p in enumerate(prompts)], indent=1))
    held = tmp_path / "held.jsonl"
    rows = [{"prompt": "2+2", "ground_truth": "4"}, {"prompt": "3+3", "ground_truth": "6"}]
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", "tiny", "--data", str(data), "--system_prompt", "",
            "--reward_fns", "trl_rewards:reward_len,trl_rewards:no_truth,trl_rewards:row_id",
            "--reward_weights", "[1.0, 0.0, 0.0]", "--reward_timeout", "5", "--eval_data", str(held),
            "--eval_steps", "2", "--eval_max_new_tokens", "4",
            "--num_generations", "4", "--max_completion_length", "8", "--learning_rate", "1e-4",
            "--temperature", "1.0", "--Q_batch_size", "2", "--get_wait", "3", "--max_steps", "2", "--save_steps", "100",
            "--train_zero_spread", "true"]  # the random tiny model's completions may all be as long: train anyway
    proc, logs = launch(tmp_path, "run", args, checks_pass)
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/no_truth"] == 1.0  # every reward call saw ground truth None
        assert 0 <= m["reward/row_id"] <= 3  # the row's other columns reached the TRL-style reward
    assert metrics[-1]["eval_n"] == 2  # evaluated on eval_data's two held-out rows, not the training prompts
    assert "Traceback" not in logs


def test_correct_on_prompt_only_data_is_refused_at_start(tmp_path):
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": "Write a haiku."}, {"prompt": "Tell a joke."}]))
    proc, logs = launch(tmp_path, "refused", ["--model", "tiny", "--data", str(data), "--reward_fns", "correct,format",
                                              "--max_steps", "2", "--save_steps", "100"])
    assert proc.returncode != 0
    line = f"reward 'correct' needs a ground truth, but data '{data}' (split 'train') is prompt-only"
    assert line in logs + proc.stderr, proc.stderr[-3000:] + logs[-3000:]
