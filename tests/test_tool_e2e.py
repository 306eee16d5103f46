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
from conftest import REPO, find_free_port, run_process_group, user_env

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


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """(a user folder with my_tools.py and my_env.py, the tiny model fine-tuned to call them): built once."""
    root = tmp_path_factory.mktemp("tools")
    user = root / "user"
    user.mkdir()
    sft = subprocess.run([sys.executable, str(REPO / "tests" / "tool_sft.py"), str(user), str(root / "model")],
                         cwd=user, env=user_env(), capture_output=True, text=True, timeout=600)
    assert sft.returncode == 0, sft.stderr[-3000:]
    return user, root / "model"


@pytest.mark.slow
def test_the_loop_on_real_hf_and_vllm_engines(tool_model):
    """Turn by turn, the completion is exactly the engine's ids plus the template's tool turns (the probe rebuilds
    it from what each engine returned); every environment instance is one rollout's (tally 1, then 2)."""
    user, model = tool_model
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tool_engine_probe.py"), str(user), str(model)],
                          cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    for backend in ("hf", "vllm"):
        for mode in ("greedy", "sampled"):
            rows = res[backend][mode]["rows"]
            assert all(r["ids_exact"] for r in rows), (backend, mode, rows)
            called = [r for r in rows if r["calls"]]
            if mode == "greedy":  # the fine-tuned trace, reproduced
                assert len(called) == 1, (backend, rows)
                for r in called:
                    assert r["tool_names"][:3] == ["add", "tally", "tally"]
                    assert r["tool_contents"][:3] == ["5", "1", "2"]
                    assert r["mask_false"] > 0 and "5" in r["last"]
            for r in called:
                assert r["mask_false"] > 0 or not r["tool_contents"]  # none: the tool turn did not fit (truncated)
                if backend == "vllm" or mode != "greedy":  # the engine's logprobs: 0 on tool tokens, the model's
                    assert r["logp_zero_on_tools"] and r["logp_nonzero_on_model"]  # elsewhere (HF: its own logits)
                else:
                    assert r["logp_zero_on_tools"] is None  # HF greedy keeps no logits (none to upload)


@pytest.mark.slow
def test_tools_end_to_end_from_a_user_folder(tool_model, checks_pass):
    user, model = tool_model
    env = user_env()
    (user / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]} for _ in range(16)]
    (user / "train.json").write_text(json.dumps(rows))
    args = ["--model", str(model), "--data", "train.json", "--system_prompt", "",
            "--tools", "my_tools.py:add", "--environment_factory", "my_env:Counter",
            "--max_tool_calling_iterations", "2", "--max_new_tokens", "200", "--max_prompt_length", "800",
            "--num_pre_Q", "4",
            "--Q_batch_size", "1", "--reward_fns", "my_rewards:used_tools", "--train_zero_spread", "true",
            "--all_steps", "5", "--save_steps", "100", "--sync_steps", "1", "--max_staleness", "4",
            "--worker_rounds", "3",  # then the worker stops: the ranks generate (HF) the rest of the batches
            "--get_wait", "0.5", "--gen_backend", "vllm", "--vllm_dtype", "float32", "--log_completions", "true",
            "--lr", "1e-5", "--seed", "1", "--temperature", "0.5"]
    port = find_free_port()  # the checks (tools, environment, rewards, template) here; train skips them
    skip = checks_pass(user, "--run-dir", "run", "--port", str(port), "--", *args)
    cmd = ["bash", str(REPO / "launch.sh"), "train", *skip, "--run-dir", "run", "--workers", "1", "--gpus", "2",
           "--port", str(port), "--", *args]
    proc = run_process_group(cmd, cwd=user, env=env, timeout=900)
    run = user / "run"
    logs = {n: (run / n).read_text() for n in ("trainer.log", "worker0.log") if (run / n).is_file()}
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(v[-3000:] for v in logs.values())
    assert "Traceback" not in "".join(logs.values())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5]
    keys = {"tools/calls_per_completion", "tools/turns_per_completion", "tools/failed", "tools/timed_out",
            "tools/malformed", "tools/seconds", "tools/add/calls", "tools/tally/calls"}
    for r in metrics:
        assert keys <= set(r), sorted(set(r))
    assert max(r["tools/calls_per_completion"] for r in metrics) > 0
    done = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    producers = {r["producer"].rstrip("0123456789") for r in done}
    assert producers == {"trainer-rank", "worker"}, producers  # HF ranks and the vLLM worker both trained on
    for who in producers:  # both producers' rollouts called the tools and got the tool turns back
        assert any("<tool_response>" in r["completion"] for r in done if r["producer"].startswith(who)), who
    # TRL's message lists reached the reward: a completion with the three tool results scored at least 1
    assert any(r["rewards"]["used_tools"] >= 1 for r in done)
    # ... its assistant turns as TRL's parse_response gives them: the calls in tool_calls, no markup in content
    said = [m for r in done for m in r["messages"] if m["role"] == "assistant"]
    assert any(m.get("tool_calls") for m in said) and not any("<tool_call>" in m["content"] for m in said)
    # the trainer trained on the model's tokens only: the tool turns' were masked (the loss mask on the wire)
    masked = [r for r in done if r["model_tokens"] < r["tokens"]]
    assert {r["producer"].rstrip("0123456789") for r in masked} == producers
    assert all("<tool_response>" in r["completion"] for r in masked), masked[0]
    assert all(r["model_tokens"] == r["tokens"] for r in done if "<tool_response>" not in r["completion"])
