"""The agent demo (`./launch.sh demo --agent`, issue 61): the openai-SDK agent examples/agents/calculator_agent.py
on the tool demo's task, and the --quick run end to end from a user's folder.

The agent owns its prompt and tool schema; it learns from the tool demo's cold-start SFT only if what it sends
renders to the token ids that SFT taught: the same prompt (the calculator's schema listed by the chat template) and
the same tool turn after its call. The test runs the real agent (the real openai SDK, over HTTP) against the real
endpoint, whose engine samples the SFT trace's own first turn, and compares the ids the endpoint fed the engine."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from agent_doubles import ScriptedEngine
from conftest import REPO, run_process_group, user_env

from common.config import GRPOConfig
from common.modeling import load_tokenizer
from common.settings.knobs import load_config_or_exit
from trainer.demo.agent_phases import AGENT, AGENT_SPEC, sft_config
from trainer.demo.tool_task import TOOL, load_arith_tools, reward_agent_answer, tool_call_message, value

KEYS = ("accuracy_before", "accuracy_after", "calls_per_rollout_before", "calls_per_rollout_after",
        "tool_calls_per_completion_before", "tool_calls_per_completion_after", "wall_seconds", "agent")


def _cfg() -> GRPOConfig:
    return load_config_or_exit(GRPOConfig, ["--config", str(REPO / "configs" / "demo_agent.json"), "--agent",
                                            AGENT_SPEC], prog="test")


def test_agent_renders_what_the_tool_sft_taught(tiny_model_dir, monkeypatch) -> None:
    from common.user_code import load_object
    from trainer.agents import serve
    from trainer.agents.runner import run_agents
    from trainer.demo.phases import _system_prompt
    from trainer.demo.tool_sft import assistant_turn_ids, sft_pairs_for
    from trainer.tools import ToolBox
    from trainer.tools.multi_turn import tool_suffix_ids

    cfg = _cfg()
    tok = load_tokenizer(str(tiny_model_dir))
    monkeypatch.syspath_prepend(str(AGENT.parent))  # where loading the agent puts its folder: undone after
    agent_mod = load_object(AGENT_SPEC).__globals__
    toolbox = ToolBox.from_config(sft_config(cfg), tok)
    try:
        # the schema the agent sends is the built-in calculator's, key order too (the template prints its JSON)
        assert json.dumps(agent_mod["CALCULATOR"]) == json.dumps(toolbox.schemas[0])
        ex = load_arith_tools("test")[0]
        (p_ids, sft_ids, mask), = sft_pairs_for(tok, toolbox, [ex], 1.0, 0, _system_prompt(cfg.system_prompt))
    finally:
        toolbox.close()
    first = assistant_turn_ids(tok, tool_call_message(ex.prompt))
    result = str(value(ex.prompt))
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": TOOL, "content": result}])
    assert sft_ids[:len(first) + len(suffix)] == first + suffix and not any(mask[len(first):len(first) + len(suffix)])
    answer = assistant_turn_ids(tok, {"role": "assistant", "content": f"<answer>{result}</answer>"})

    engine = ScriptedEngine(tok, [first, answer])  # samples the SFT trace's turns, token by token
    server = serve(engine, tok, model="tiny", max_new_tokens=cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, max_calls=cfg.max_tool_calling_iterations)
    try:
        run, = run_agents(server, load_object(AGENT_SPEC), [{"prompt": ex.prompt, **ex.columns}], timeout=60)
    finally:
        server.close()
    assert run.error is None, run.error
    (ctx1, got1), (ctx2, got2) = engine.rec.served()
    assert ctx1 == p_ids  # the agent's first request: the SFT prompt, token for token
    assert got1 == first and ctx2 == p_ids + first + suffix  # its tool turn: the SFT's (tool message `name` unused)
    # the trained row is the SFT trace with the same loss mask, and the demo's reward reads the answer turn
    row, = run.session.rows()
    assert row.prompt_ids == p_ids and row.completion_ids.tolist() == sft_ids
    assert row.loss_mask.tolist() == mask
    conv = run.session.completion_messages()
    assert [m["role"] for m in conv] == ["assistant", "tool", "assistant"] and conv[1]["content"] == result
    assert reward_agent_answer([conv], [ex.ground_truth]) == [1.0]


def test_reward_reads_the_last_assistant_answer() -> None:
    gt = "1781"
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": TOOL, "arguments": '{"expression": "37*48+5"}'}}]}
    tool = {"role": "tool", "content": "<answer>1781</answer>"}  # the tool's text is never the model's answer
    assert reward_agent_answer([[call, tool, {"role": "assistant", "content": "<answer>1781</answer>"}],
                                [call, tool], [{"role": "assistant", "content": "<answer>1780</answer>"}]],
                               [gt, gt, gt]) == [1.0, -1.0, pytest.approx(-1.0 + 3 / 5)]


def test_agent_flag_parses(tmp_path: Path) -> None:
    from trainer.demo.cli import AGENT_CONFIG, parse_args

    a, _ = parse_args(["--agent", "--run-dir", str(tmp_path), "--seed", "2"])
    assert (a.agent, a.tools, a.data, a.config, a.seed) == (True, False, "arith_tools", str(AGENT_CONFIG), 2)
    for bad in (["--agent", "--tools"], ["--agent", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    cfg = _cfg()
    assert cfg.agent == AGENT_SPEC and cfg.max_tool_calling_iterations >= 2 and not cfg.tools


@pytest.mark.slow
def test_demo_agent_quick_end_to_end(tmp_path: Path) -> None:
    user = tmp_path / "user folder"
    user.mkdir()
    t0 = time.time()
    proc = run_process_group([str(REPO / "launch.sh"), "demo", "--agent", "--quick", "--seed", "3", "--run-dir",
                              "run", "--", "--log_completions", "true"], cwd=user, env=user_env(), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for line in ("1/5", "2/5", "3/5", "4/5", "5/5", "endpoint calls per rollout"):
        assert line in proc.stdout, out[-4000:]
    run_dir = user / "run"  # relative to the user's folder
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in KEYS:
        assert key in summary, (key, summary)
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert 1.0 <= summary["calls_per_rollout_before"] <= 2.0  # the agent called the endpoint, at most twice
    assert summary["seed"] == 3 and summary["data"] == "arith_tools" and summary["agent"] == AGENT_SPEC
    assert 0 < summary["wall_seconds"] <= time.time() - t0 + 1

    grpo = run_dir / "grpo"
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, summary["steps"] + 1))
    # the genonly worker served the agent's rollouts on its endpoint, and uploaded them
    log = (grpo / "worker0.log").read_text()
    assert re.search(r"agent \S+calculator_agent\.py:solve: serving its rollouts on 127\.0\.0\.1:\d+", log), log[-2000:]
    done = re.search(r"worker done: \d+ rounds, (\d+) batches uploaded", log)
    assert done and int(done.group(1)) > 0, log[-2000:]
    # completions.jsonl holds the agent's conversations, scored by the run's conversational reward
    comp = [json.loads(line) for line in (grpo / "completions.jsonl").read_text().splitlines() if line.strip()]
    assert comp and all(c["producer"] == "worker0" and isinstance(c["completion"], list)
                        and c["completion"][0]["role"] == "assistant"
                        for c in comp), comp[:1]
    assert all("reward_agent_answer" in c["rewards"] for c in comp), comp[:1]
    cfg = json.loads((grpo / "config.json").read_text())
    assert cfg["agent"] == AGENT_SPEC and cfg["data"] == "arith_tools" and not cfg["tools"]
