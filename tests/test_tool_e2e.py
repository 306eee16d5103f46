"""Tools end to end (issue 32): `launch.sh train` from a user's folder outside the checkout, PYTHONPATH unset, with a
TRL-style tool function of that folder (`my_tools.py:add`) and an `environment_factory` stateful class
(`my_env:Counter`); the ranks generate with HF, one genonly worker with vLLM. The model is the tiny one fine-tuned to
call the tools (tests/tool_sft.py), so tool calls happen from the first step.

Checked: tool calls happened in both producers' batches (completions.jsonl says who produced each), each
environment instance is one rollout's (tally reads 1 then 2 in every rollout), the rewards got TRL's message
lists, the trainer trained with the tool tokens masked (completions.jsonl's model_tokens < tokens), and the
tools/... metrics are in metrics.jsonl.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, find_free_port, subprocess_env

from common.user_code import USER_DIR_ENV

REWARDS = '''
def used_tools(prompts, completions, **kwargs):
    """TRL-style: each completion is a list of messages; the share of the trace's three tool results seen, and 1
    more when the last assistant turn answers 5."""
    out = []
    for c in completions:
        tools = [m["content"] for m in c if m["role"] == "tool"]
        out.append(len(tools) / 3 + float(c[-1]["role"] == "assistant" and "5" in c[-1]["content"]))
    return out
'''


@pytest.mark.slow
def test_tools_end_to_end_from_a_user_folder(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    env = subprocess_env()
    for k in ("PYTHONPATH", USER_DIR_ENV):
        env.pop(k, None)
    sft = subprocess.run([sys.executable, str(REPO / "tests" / "tool_sft.py"), str(user), str(tmp_path / "model")],
                         cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert sft.returncode == 0, sft.stderr[-3000:]
    (user / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]} for _ in range(16)]
    (user / "train.json").write_text(json.dumps(rows))
    args = ["--model", str(tmp_path / "model"), "--data", "train.json", "--system_prompt", "",
            "--tools", "my_tools.py:add", "--environment_factory", "my_env:Counter",
            "--max_tool_calling_iterations", "2", "--max_new_tokens", "200", "--num_pre_Q", "4",
            "--Q_batch_size", "1", "--reward_fns", "my_rewards:used_tools", "--train_zero_spread", "true",
            "--all_steps", "4", "--save_steps", "100", "--sync_steps", "1", "--max_staleness", "3",
            "--get_wait", "3", "--gen_backend", "vllm", "--vllm_dtype", "float32", "--log_completions", "true",
            "--lr", "1e-5", "--seed", "1"]
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--run-dir", "run", "--workers", "1", "--gpus", "2",
           "--port", str(find_free_port()), "--", *args]
    proc = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=900)
    run = user / "run"
    logs = {n: (run / n).read_text() for n in ("trainer.log", "worker0.log") if (run / n).is_file()}
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(v[-3000:] for v in logs.values())
    assert "Traceback" not in "".join(logs.values())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    keys = {"tools/calls_per_completion", "tools/turns_per_completion", "tools/failed", "tools/timed_out",
            "tools/malformed", "tools/seconds", "tools/add/calls", "tools/tally/calls"}
    for r in metrics:
        assert keys <= set(r), sorted(set(r))
    assert max(r["tools/calls_per_completion"] for r in metrics) > 0
    done = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    producers = {r["producer"].rstrip("0123456789") for r in done}
    assert producers == {"trainer-rank", "worker"}, producers  # HF ranks and the vLLM worker both trained on
    for who in producers:
        mine = [r for r in done if r["producer"].startswith(who)]
        called = [r for r in mine if "<tool_response>" in r["prompt"] + r["completion"] or r["model_tokens"] <
                  r["tokens"]]
        assert called, (who, mine[0])
        for r in called:  # the trainer trained on the model's tokens only: the tool turn's were masked
            assert r["model_tokens"] < r["tokens"], r
