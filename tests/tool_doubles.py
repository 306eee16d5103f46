"""Doubles for the tool-loop unit tests: a scripted engine (deterministic turns, chosen token by token so that
decode + encode does not give them back) and a ToolBox with the runtime's face over plain in-process functions
(the real ToolBox, with its executor process, is in the slow tests: tests/test_tool_e2e.py)."""
from __future__ import annotations

import torch

from trainer.engines.base import GenEngine, Sample, budgets, cut_at_eos


def spelled(tok, text: str) -> list[int]:
    """`text` one character per token where the vocabulary has the character: a tokenisation BPE would never
    produce (encode merges them), so a loop that re-tokenised decoded text could not give these ids back."""
    out = []
    for ch in text:
        ids = tok.convert_tokens_to_ids([tok.convert_ids_to_tokens(tok.encode(ch))[0]]) if ch != " " else \
            tok.encode(" ")
        out += ids
    return out


class ScriptEngine(GenEngine):
    """Turn k of every rollout is turns[k] (the number of tool responses already in the context says which turn),
    with logprob -(position + 1) / 100 per token, so the test can tell which engine token went where."""

    def __init__(self, tok, turns: list[list[int]], response_id: int, logprobs: bool = True):
        self.tok, self.turns, self.response_id, self.with_logprobs = tok, turns, response_id, logprobs
        self.eos_ids = [tok.eos_token_id]
        self.calls: list[tuple[int, int]] = []  # (prompts, max_new_tokens) of each generate call
        self.last_prompts: list[list[int]] = []  # the prompts of the first call

    def generate(self, prompt_ids, n, *, max_new_tokens, greedy=False):
        self.calls.append((len(prompt_ids), max_new_tokens))
        self.last_prompts = [list(p) for p in prompt_ids] if len(self.calls) == 1 else self.last_prompts
        out = []
        for p, limit in zip(prompt_ids, budgets(max_new_tokens, len(prompt_ids))):
            for _ in range(n):
                ids, trunc = cut_at_eos(torch.tensor(self.turn(p, len(out))), self.eos_ids, limit)
                lp = -(torch.arange(len(ids), dtype=torch.float32) + 1) / 100 if self.with_logprobs else None
                out.append(Sample(list(p), ids, lp, trunc))
        return out

    def turn(self, prompt: list[int], index: int) -> list[int]:
        """The turn for this context (index: its place in the call)."""
        return self.turns[min(prompt.count(self.response_id), len(self.turns) - 1)]


# --- the tool runtime's face (trainer/tools): ToolCall, ToolResult, ToolBox ---------------------------------------
import json  # noqa: E402
import re  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass
class Call:
    name: str
    arguments: dict
    id: str | None = None

    def to_dict(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Result:
    name: str
    content: str
    status: str
    seconds: float = 0.0

    def to_message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


class FakeToolBox:
    """ToolBox's face over plain in-process functions: Qwen2.5's <tool_call>{json}</tool_call> parsing, a raising
    tool becomes an "error" result, an unknown one "unknown_tool"."""

    def __init__(self, fns: dict, template_kwargs: dict | None = None):
        self.fns = fns
        self.template_kwargs = dict(template_kwargs or {})  # ToolBox's: every render's apply_chat_template arguments
        self.schemas = [{"type": "function", "function": {"name": k, "description": k, "parameters": {}}}
                        for k in fns]
        self.started: list[int] = []
        self.ended: list[int] = []
        self.jobs: list = []
        self.observations: dict = {}
        self.reset_kwargs: list = []
        self.observe = None  # fn(reset kwargs) -> what reset() returns (an environment's first observation)
        self.reward = None  # fn(episode id) -> get_reward()'s value (an environment that owns a reward), as "Env"
        self.rewarded: list[tuple[int, bool]] = []  # (episode, still live when its reward was read)

    def prompt_tools(self, row: dict):
        return self.schemas or None

    def parse(self, text: str, prefix: str = ""):
        calls, bad = [], []
        for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S):
            try:
                d = json.loads(m.group(1))
                calls.append(Call(d["name"], d.get("arguments", {})))
            except (ValueError, KeyError) as e:
                bad.append(Result("", f"malformed tool call: {e}", "malformed"))
        return calls, bad

    def start_episodes(self, n: int, reset_kwargs=None) -> list[int]:
        ids = list(range(len(self.started), len(self.started) + n))
        self.started += ids
        self.reset_kwargs += reset_kwargs or [{}] * n
        for i, kw in zip(ids, reset_kwargs or [{}] * n):
            self.observations[i] = self.observe(kw) if self.observe else None
        return ids

    def run(self, jobs):
        self.jobs += jobs
        out = []
        for _, calls in jobs:
            res = []
            for c in calls:
                if c.name not in self.fns:
                    res.append(Result(c.name, f"unknown tool {c.name}", "unknown_tool"))
                    continue
                try:
                    res.append(Result(c.name, str(self.fns[c.name](**c.arguments)), "ok", 0.5))
                except Exception as e:  # noqa: BLE001 - a tool's own failure is a message, as the runtime says it
                    res.append(Result(c.name, f"error: {e}", "error", 0.25))
            out.append(res)
        return out

    def episode_rewards(self, ids) -> list:
        self.rewarded += [(i, i not in self.ended) for i in ids]
        return [None if self.reward is None else {"Env": self.reward(i)} for i in ids]

    def episode_snapshots(self, ids) -> list:
        """TRL's `environments`: a copy of each episode's instance (a Counter at its episode id + 1); the order of
        the calls (copied before get_reward() and the end) in `copied`."""
        from tests.tools_user_code import Counter
        from trainer.rewards.environments import snapshot

        self.copied = [(i, not any(r == i for r, _ in self.rewarded), i not in self.ended) for i in ids]
        out = []
        for i in ids:
            env = Counter()
            env.value = i + 1
            out.append(snapshot(env, "tests.tools_user_code:Counter"))
        return out

    def end_episodes(self, ids) -> None:
        self.ended += list(ids)

    def close(self) -> None:
        pass
