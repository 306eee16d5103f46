"""The tool demo's task (`./launch.sh demo --tools`; data source "arith_tools"): `ab*cd+e`, e.g. "37*48+5".

A two-digit by two-digit product is beyond the tiny model's own arithmetic (it learns the digit-by-digit
`a o b o c` of arith.py, not long multiplication), but easy with the built-in `calculator`: copy the expression
into the call, copy the result into the answer. The factors are 32-99, so every value has 4 digits (32*32 = 1024):
copying it is then the same positional move for every problem, which the tiny model learns in a few hundred SFT
steps (with 3- and 4-digit values mixed it had not after 250). All 68 x 68 x 10 = 46,240 problems exist; a fixed
seeded permutation holds 1,000 out (the test split).

The cold-start SFT (trainer/demo/tool_sft.py) sees two kinds of worked solution, chosen at random per example:
  with the tool      assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37*48+5"}}</tool_call>
                     tool:      1781
                     assistant: <answer>1781</answer>
  by itself          assistant: <think>37*48=1776,1776+5=1781</think><answer>1781</answer>
The choice is a coin flip, not a property of the problem, so the SFT model calls the tool on some prompts and
not others; GRPO then learns that calling it pays (the by-itself products are mostly wrong).
"""
from __future__ import annotations

import itertools
import random
import re

from trainer.data.example import Example

HELD_OUT = 1000
SPLIT_SEED = 4321  # fixed: the held-out set is the same for every run seed
TOOL = "calculator"
LOW = 32  # smallest factor: 32 * 32 = 1024, so every value has 4 digits


def all_problems() -> list[str]:
    return [f"{a}*{b}+{c}" for a, b, c in itertools.product(range(LOW, 100), range(LOW, 100), range(10))]


def parse(problem: str) -> tuple[int, int, int]:
    """"37*48+5" -> (37, 48, 5)."""
    m = re.fullmatch(r"(\d\d)\*(\d\d)\+(\d)", problem)
    if m is None or min(int(m.group(1)), int(m.group(2))) < LOW:
        raise ValueError(f"not an arith_tools problem: {problem!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def value(problem: str) -> int:
    a, b, c = parse(problem)
    return a * b + c


def load_arith_tools(split: str = "train") -> list[Example]:
    """split: 'train' (45,240 problems) or 'test' (the 1,000 held out)."""
    if split not in ("train", "test"):
        raise ValueError(f"arith_tools has splits 'train' and 'test', not {split!r}")
    probs = all_problems()
    random.Random(SPLIT_SEED).shuffle(probs)
    chosen = probs[:HELD_OUT] if split == "test" else probs[HELD_OUT:]
    # ground_truth also as a column: TRL-style rewards (the agent demo's) take the dataset's columns as keywords
    return [Example(prompt=p, ground_truth=str(value(p)), columns={"ground_truth": str(value(p))}) for p in chosen]


def own_solution(problem: str) -> str:
    """The worked solution without the tool: the product, then the sum."""
    a, b, c = parse(problem)
    return f"<think>{a}*{b}={a * b},{a * b}+{c}={a * b + c}</think><answer>{a * b + c}</answer>"


def tool_call_message(problem: str) -> dict:
    """The assistant turn that asks the calculator (TRL's message layout: tool_calls with a function)."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": TOOL, "arguments": {"expression": problem}}}]}


def answer_text(result: str) -> str:
    """The assistant's last turn after the tool replied: the result, as read from the tool message."""
    return f"<answer>{result.strip()}</answer>"


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def reward_tool_answer(completion: str, ground_truth: str) -> float:
    """+1 when the last <answer>...</answer> holds the value; otherwise -1 plus partial credit, up to (but below) 0,
    for the digits it has right in their places: -1 + right/len(value). No <answer>: -1.

    Only the model's answer counts: a number elsewhere in the text (with tools, the tool's own output is there)
    gets no credit, unlike the built-in `correct`. The partial credit gives GRPO a signal before any answer is
    exactly right: copying the calculator's result digit by digit scores above guessing them."""
    spans = _ANSWER.findall(completion)
    if not spans:
        return -1.0
    got, want = spans[-1].strip(), str(ground_truth).strip()
    if got == want:
        return 1.0
    right = sum(a == b for a, b in zip(got, want)) if len(got) == len(want) else 0
    return -1.0 + right / (len(want) + 1)


def reward_agent_answer(completions: list[list[dict]], ground_truth: list[str], **_) -> list[float]:
    """The agent demo's reward (`./launch.sh demo --agent`), TRL's conversational signature: reward_tool_answer on
    the last assistant message of each conversation (its last <answer>; the tool message's number never counts)."""
    return [reward_tool_answer(_last_assistant(c), g) for c, g in zip(completions, ground_truth)]


def _last_assistant(messages: list[dict]) -> str:
    said = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
    return said[-1] if said else ""


def is_correct(completion: str, ground_truth: str) -> bool:
    """The demo's accuracy: the last <answer> holds exactly the value."""
    return reward_tool_answer(completion, ground_truth) == 1.0
