"""The tool demo (`./launch.sh demo --tools`, issue 32): its task, its SFT traces, and the --quick run end to end.

The traces must be the token sequences the tool loop builds (trainer/tools/multi_turn.py), or SFT would teach a format
the rollouts never produce; the end-to-end run checks summary.json's keys and that GRPO's batches came from the
real processes with multi-turn rollouts (the worker uploaded batches; the ranks' metrics count tool calls).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_process_group, subprocess_env

from common.config import GRPOConfig
from common.modeling import load_model, load_tokenizer
from trainer.demo.tool_task import is_correct, load_arith_tools, own_solution, reward_tool_answer, value
from trainer.tools import ToolBox

KEYS = ("accuracy_before", "accuracy_after", "tool_calls_per_completion_before", "tool_calls_per_completion_after",
        "accuracy_without_tools", "wall_seconds")


def test_task_splits_and_values() -> None:
    train, test = load_arith_tools("train"), load_arith_tools("test")
    assert len(test) == 1000 and len(train) == 45_240
    assert not {e.prompt for e in test} & {e.prompt for e in train[:5000]}
    ex = test[0]
    assert int(ex.ground_truth) == value(ex.prompt) == eval(ex.prompt)  # noqa: S307 - our own "ab*cd+e" string
    assert own_solution("37*48+5") == "<think>37*48=1776,1776+5=1781</think><answer>1781</answer>"


def test_reward_reads_only_the_models_answer() -> None:
    assert reward_tool_answer("<answer>1781</answer>", "1781") == 1.0
    assert reward_tool_answer("<answer>17</answer> x <answer>1781</answer>", "1781") == 1.0
    # partial credit below 0 for digits right in place: copying most of the result beats guessing
    assert reward_tool_answer("<answer>1780</answer>", "1781") == pytest.approx(-1.0 + 3 / 5)
    assert reward_tool_answer("<answer>9999</answer>", "1781") == -1.0
    assert reward_tool_answer("<answer>17810</answer>", "1781") == -1.0
    assert is_correct("<answer>1781</answer>", "1781") and not is_correct("<answer>1780</answer>", "1781")
    # the tool's own output in the text is no answer of the model's (the built-in `correct` would count it)
    assert reward_tool_answer("<tool_call>..</tool_call>user\n<tool_response>\n1781\n</tool_response>", "1781") == -1.0


def test_traces_are_what_the_tool_loop_builds(tiny_model_dir) -> None:
    from trainer.demo.tool_sft import assistant_turn_ids, sft_pairs_for
    from trainer.tools.multi_turn import tool_suffix_ids

    tok = load_tokenizer(str(tiny_model_dir))
    toolbox = ToolBox.from_config(GRPOConfig(model="tiny", tools=["calculator"]), tok)
    try:
        exs = load_arith_tools("train")[:40]
        pairs = sft_pairs_for(tok, toolbox, exs, 0.5, 0, "")
        kinds = set()
        for ex, (p_ids, ids, mask) in zip(exs, pairs):
            assert "calculator" in tok.decode(p_ids)  # the prompt lists the tool, as the rollouts' prompts do
            assert len(ids) == len(mask) and ids[-1] == tok.eos_token_id
            if all(mask):  # by itself: one turn
                kinds.add("own")
                assert tok.decode(ids, skip_special_tokens=True) == own_solution(ex.prompt)
                continue
            kinds.add("tool")
            first_end = ids.index(tok.eos_token_id) + 1
            off = [i for i, m in enumerate(mask) if not m]
            assert off == list(range(first_end, off[-1] + 1))  # one masked block, right after the first turn
            calls, bad = toolbox.parse(tok.decode(ids[:first_end], skip_special_tokens=False))
            assert not bad and [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": ex.prompt})]
            result = str(value(ex.prompt))
            assert ids[first_end:off[-1] + 1] == tool_suffix_ids(tok, [{"role": "tool", "name": "calculator",
                                                                         "content": result}])
            assert ids[off[-1] + 1:] == assistant_turn_ids(tok, {"role": "assistant",
                                                                 "content": f"<answer>{result}</answer>"})
        assert kinds == {"own", "tool"}
    finally:
        toolbox.close()


def test_sft_shared_prompt_head_gives_the_plain_loss_and_gradients(tiny_model_dir) -> None:
    from trainer.demo import sft

    torch.manual_seed(0)
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32", trainable=True)
    head = list(range(5, 5 + sft.SHARED_HEAD_MIN + 8))
    batch = [(head + [40, 41], [50, 51, 52, 2], [True, False, True, True]),
             (head + [42], [53, 2], [True, True]),
             (head + [43, 44, 45], [54, 55, 56, 57, 2], [True, True, True, False, True])]
    grads = []
    for shared in (True, False):
        model.zero_grad()
        min_head, sft.SHARED_HEAD_MIN = sft.SHARED_HEAD_MIN, (sft.SHARED_HEAD_MIN if shared else 10 ** 9)
        try:
            loss = sft._batch_loss(model, 0, batch)
        finally:
            sft.SHARED_HEAD_MIN = min_head
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()]))
    (l1, g1), (l2, g2) = grads
    assert abs(l1 - l2) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


def test_tools_flag_parses(tmp_path: Path) -> None:
    from trainer.demo.cli import TOOLS_CONFIG, parse_args

    a, _ = parse_args(["--tools", "--run-dir", str(tmp_path), "--seed", "2"])
    assert (a.tools, a.data, a.config, a.seed) == (True, "arith_tools", str(TOOLS_CONFIG), 2)
    with pytest.raises(SystemExit):
        parse_args(["--tools", "--model", "Qwen/Qwen2.5-0.5B-Instruct"])


@pytest.mark.slow
def test_demo_tools_quick_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "tool demo"
    t0 = time.time()
    proc = run_process_group([str(REPO / "launch.sh"), "demo", "--tools", "--quick", "--seed", "3", "--run-dir",
                             str(run_dir)], cwd=REPO, env=subprocess_env(), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for line in ("1/5", "2/5", "3/5", "4/5", "5/5", "tool calls per completion", "accuracy without tools"):
        assert line in proc.stdout, out[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in KEYS:
        assert key in summary, (key, summary)
    for key in ("accuracy_before", "accuracy_after", "accuracy_without_tools"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary)
    assert summary["tool_calls_per_completion_before"] >= 0 and summary["tool_calls_per_completion_after"] >= 0
    assert summary["seed"] == 3 and summary["data"] == "arith_tools" and summary["tools"] == ["calculator"]
    assert 0 < summary["wall_seconds"] <= time.time() - t0 + 1

    grpo = run_dir / "grpo"
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, summary["steps"] + 1))
    # the rollouts ran the tool loop: the ranks' metrics carry its counters
    assert all("tools/calls_per_completion" in r for r in train), train[-1]
    # the genonly worker really fed the server (multi-turn rollouts with the calculator), and stopped when done
    log = (grpo / "worker0.log").read_text()
    done = re.search(r"worker done: \d+ rounds, (\d+) batches uploaded", log)
    assert done and int(done.group(1)) > 0, log[-2000:]
    cfg = json.loads((grpo / "config.json").read_text())
    assert cfg["tools"] == ["calculator"] and cfg["data"] == "arith_tools"
