"""One rollout's calls, recorded token-exact: what the engine consumed and sampled, with the sampler's logprobs and
the policy version, and the rows the session trains as.

A call *extends* the session's current segment when its messages are the previous request's messages plus the reply
the endpoint gave (trainer/agents/requests.py `normalized`: content None <-> "", arguments string <-> dict, tool-call
ids and reasoning left out of the comparison) followed by new messages, with the same tools. Then the recorded ids
are kept as they are, and appended with the loss masked: the template's turn end where the model did not close its
turn (a `length` or `stop`-string reply), and the new messages' tokens (trainer/agents/chat.py). Anything else (the
agent rewrote or cut its history, changed its tools, or switched between chat and text completions) starts a new
segment from the request's own rendering: never a re-tokenisation of sampled tokens. Each segment is one training
row, a Sample as the tool loop makes it (trainer/tools/multi_turn.py): prompt ids, completion ids, logprobs (0 on masked
tokens; None when the engine gives none, as HF), the truncated flag, loss_mask True on sampled tokens only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from trainer.engines.base import Sample


def _key(messages: list[dict]) -> list[dict]:
    """Messages as compared for extension: ids and reasoning are the endpoint's bookkeeping, not the conversation."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("reasoning_content", "tool_call_id")}
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": c["function"]} for c in m["tool_calls"]]
        out.append(m)
    return out


@dataclass
class Call:
    """One call as the engine served it."""
    context_ids: list[int]        # everything the engine consumed
    sampled_ids: list[int]        # what it sampled (after a stop string: up to the token that completed it)
    logprobs: list[float] | None  # the sampler's, one per sampled id (None: the engine gives none)
    version: int                  # the policy version that sampled it
    finish_reason: str            # stop | length | tool_calls


@dataclass
class Segment:
    """One training row: a prompt and every token after it, sampled or appended."""
    kind: str                     # "chat" or "text"
    prompt_ids: list[int]
    first: list[dict] | str       # the request that opened it (messages, or the text prompt)
    tools: list[dict] | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logps: list[float] | None = field(default_factory=list)
    history: list[dict] | str | list[int] = field(default_factory=list)  # what a call must start with to extend
    last_reply: dict | None = None
    closed: bool = True           # the last reply ended with a stop token
    truncated: bool = False
    calls: list[Call] = field(default_factory=list)
    history_replies: list[str] = field(default_factory=list)  # text segments: each reply's text

    def append(self, ids: list[int], sampled: bool, logps: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [sampled] * len(ids)
        if self.logps is not None:
            self.logps = None if sampled and logps is None else self.logps + (logps if sampled else [0.0] * len(ids))

    def sample(self) -> Sample:
        return Sample(list(self.prompt_ids), torch.tensor(self.ids, dtype=torch.long),
                      None if self.logps is None else torch.tensor(self.logps, dtype=torch.float32),
                      self.truncated, torch.tensor(self.mask, dtype=torch.bool))

    def added_messages(self) -> list[dict]:
        """What the segment's calls added after the request that opened it (TRL's conversational completion)."""
        if self.kind == "text":
            return [{"role": "assistant", "content": c} for c in self.history_replies]
        return [{k: v for k, v in m.items() if k not in ("reasoning_content", "tool_call_id")}
                for m in self.history[len(self.first):]]


class Session:
    """A rollout's calls. Calls of one session are served one at a time (`lock`): each extends what the last left."""

    def __init__(self, session_id: str):
        self.id = session_id
        self.lock = threading.Lock()
        self.segments: list[Segment] = []
        self.calls = 0        # calls served (those refused past the limits included)
        self.sampled = 0      # sampled tokens over every segment (max_completion_length bounds it)
        self.refused = 0      # calls answered `length` without generating (budget or call limit spent)
        self.closed = False
        self.started = False  # its agent was called (trainer/agents/runner.py): its first call is coming

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def extends_chat(self, messages: list[dict], tools: list[dict] | None) -> list[dict] | None:
        """The new messages when `messages` extend the current chat segment, else None."""
        seg = self.current
        if seg is None or seg.kind != "chat" or seg.last_reply is None or seg.tools != tools:
            return None
        n = len(seg.history)
        if len(messages) <= n or _key(messages[:n]) != _key(seg.history):
            return None
        return messages[n:]

    def extends_text(self, prompt: str | list[int]) -> str | list[int] | None:
        """The new part of a text (or token-id) prompt that extends the current text segment, else None."""
        seg = self.current
        if seg is None or seg.kind != "text" or type(prompt) is not type(seg.history) or not seg.calls:
            return None
        n = len(seg.history)
        if len(prompt) <= n or prompt[:n] != seg.history:
            return None
        return prompt[n:]

    def record(self, seg: Segment, added: list[int], call: Call, reply: dict | str, stop_ids: list[int],
               history: list[dict] | str | list[int]) -> None:
        """A served call: `added` (masked) then the sampled ids into `seg` (a new one is appended first)."""
        if not seg.calls and (not self.segments or self.segments[-1] is not seg):
            self.segments.append(seg)
        seg.append(added, sampled=False)
        seg.append(call.sampled_ids, sampled=True, logps=call.logprobs)
        seg.calls.append(call)
        seg.closed = bool(call.sampled_ids) and call.sampled_ids[-1] in stop_ids
        seg.truncated = call.finish_reason == "length"
        seg.history = history
        if isinstance(reply, dict):
            seg.last_reply = reply
        else:
            seg.history_replies.append(reply)
        self.sampled += len(call.sampled_ids)

    def rows(self) -> list[Sample]:
        """One Sample per segment that sampled anything (a training row each)."""
        return [s.sample() for s in self.segments if s.calls]

    def prompt_messages(self) -> list[dict] | str | None:
        """The session's first request's messages (TRL's `prompts` for its rewards); None before any call."""
        return self.segments[0].first if self.segments else None

    def completion_messages(self) -> list[dict]:
        """The conversation after the first request's messages: each segment's added messages, in order."""
        return [m for s in self.segments for m in s.added_messages()]

    def stats(self) -> dict:
        calls = [c for s in self.segments for c in s.calls]
        return {"calls": self.calls, "turns": len(calls), "segments": len([s for s in self.segments if s.calls]),
                "refused": self.refused, "sampled_tokens": self.sampled,
                "policy_versions": [c.version for c in calls], "finish_reasons": [c.finish_reason for c in calls]}
