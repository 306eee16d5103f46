"""Issue 61 from a user's folder, with no PYTHONPATH, through launch.sh: an `async def` agent written with the openai
SDK (two calls: an answer offered a function tool with tool_choice auto, then a follow-up user turn) trains with an
HF genonly worker and with a vLLM one on the tiny model; completions.jsonl holds its conversation, and its own float
reward is logged under its name. One run per engine, shared by the tests that read it; launch.sh train's checks
run the agent once first (trainer/check_agent.py)."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO, find_free_port, run_process_group, user_env

AGENT_FILE = '''
import openai

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


async def solve(base_url, model, prompt, answer):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP], tool_choice="auto",
                                                 max_tokens=8)
    reply = first.choices[0].message
    messages += [reply.model_dump(), {"role": "user", "content": "Say it again."}]  # extends the same row
    second = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP], max_tokens=8)
    text = (reply.content or "") + (second.choices[0].message.content or "")
    return float(answer in text) + len(text) / 1000  # its own verdict: a spread even for a random model
'''

REWARD_FILE = '''
def user_turns(prompts, completions, **kwargs):
    """TRL's conversational signature: the session's first request's messages, the messages added after them."""
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts), prompts
    return [float(sum(m["role"] == "user" for m in c)) for c in completions]
'''


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"))])
def agent_run(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"agent_user_{request.param}")
    (folder / "my_agent.py").write_text(AGENT_FILE)
    (folder / "my_rewards.py").write_text(REWARD_FILE)
    (folder / "train.json").write_text(json.dumps([{"prompt": f"Write {n}.", "answer": str(n)} for n in range(8)]))
    args = ["--model", "tiny", "--data", "train.json", "--agent", "my_agent.py:solve",
            "--reward_fns", "my_rewards.py:user_turns", "--num_pre_Q", "4", "--Q_batch_size", "2",
            "--max_new_tokens", "64", "--all_steps", "2", "--get_wait", "240", "--log_completions", "true",
            "--train_zero_spread", "true", "--save_steps", "100", "--agent_timeout", "60",
            "--gen_backend", request.param]
    # the checks run the agent over an HF engine whatever the workers' engine: once (the HF run) is enough
    skip = ["--skip-checks"] if request.param != "hf" else []
    cmd = ["bash", str(REPO / "launch.sh"), "train", *skip, "--run-dir", "run", "--workers", "1", "--gpus", "1",
           "--port", str(find_free_port()), "--", *args]
    proc = run_process_group(cmd, cwd=folder, env=user_env(), timeout=400)
    run_dir = folder / "run"
    logs = {n: (run_dir / n).read_text() for n in ("trainer.log", "worker0.log") if (run_dir / n).is_file()}
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(v[-3000:] for v in logs.values())
    # launch.sh train's checks ran the agent once against the real endpoint, and printed what it recorded
    said = proc.stdout + proc.stderr
    if skip:
        return run_dir, logs
    assert "[check] ok   agent    my_agent.py:solve ran on row 0" in said, said[-3000:]
    assert "[check]      | user: 'Say it again.'" in said and "trained (sampled)" in said
    assert "[check]      | <|im_start|>user" in said and "You are a helpful assistant" not in said  # no system prompt
    return run_dir, logs


@pytest.mark.slow
def test_an_openai_sdk_agent_trains_and_completions_hold_its_conversation(agent_run):
    run_dir, logs = agent_run
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["batches_from_ranks"] == 0 and r["batches_from_workers"] >= 1 for r in rows), rows
    # every session made its two calls into one training row; no rollout lost its reward
    assert all((r["agent/calls_per_rollout"], r["agent/segments_per_rollout"], r["agent/faults"]) == (2.0, 1.0, 0)
               for r in rows), rows
    done = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert done and all(r["producer"] == "worker0" for r in done)
    for r in done:  # the session's conversation after its first request: reply, the follow-up, the second reply
        conv = r["completion"]
        assert [m["role"] for m in conv] == ["assistant", "user", "assistant"], conv
        assert conv[1]["content"] == "Say it again." and all(isinstance(m["content"], str) for m in conv)
        assert r["rewards"]["user_turns"] == 1.0 and r["model_tokens"] < r["tokens"]  # the user turn: masked
    assert "serving its rollouts on 127.0.0.1" in logs["worker0.log"] and "Traceback" not in "".join(logs.values())


@pytest.mark.slow
def test_an_async_agents_own_float_is_logged_under_its_name(agent_run):
    run_dir, _ = agent_run
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert all("reward/solve" in r and "reward/user_turns" in r for r in rows), rows[0]
    done = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    own = [r["rewards"]["solve"] for r in done]
    assert all(isinstance(v, float) and v > 0 for v in own), own  # the agent's float, not None
    assert all(r["reward"] == pytest.approx(r["rewards"]["solve"] + 1.0) for r in done)  # weight 1, summed
