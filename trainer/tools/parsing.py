"""The tool calls in one assistant turn's decoded text.

Two parsers:
- a run's: transformers' own `tokenizer.parse_response` with the response template TRL 1.16 sets for the model's
  family (trainer/tools/templates.py; a model of no known family is refused before any rollout). It also casts
  arguments to the tools' schema types. It reads the whole turn: a call it cannot parse makes the turn one
  "malformed" result (it does not say which call).
- without a tokenizer (the tools' unit tests): Qwen2.5's format, any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; each is parsed on its own, so one broken call
  is one "malformed" result next to the others' calls.
Every result's content is one line the model reads in the tool message.
"""
from __future__ import annotations

import json
import re

from trainer.tools.types import ToolCall, ToolResult, one_line

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def malformed(message: str) -> ToolResult:
    return ToolResult(name="", content=f"Error: malformed tool call: {one_line(message)}", status="malformed")


def check_call(obj, where: str) -> ToolCall | ToolResult:
    """A decoded call object -> ToolCall, or the malformed result saying what is wrong with it."""
    if not isinstance(obj, dict):
        return malformed(f"{where} is {type(obj).__name__}, not a JSON object with \"name\" and \"arguments\"")
    if isinstance(obj.get("function"), dict):  # OpenAI / transformers shape {"type": "function", "function": {...}}
        call_id = obj.get("id")
        obj = obj["function"]
    else:
        call_id = obj.get("id")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name.strip():
        return malformed(f"{where} has no \"name\" string")
    if args is None:  # some templates omit the arguments of a call without any
        args = {}
    if not isinstance(args, dict):
        return malformed(f"{where}: \"arguments\" of {name!r} must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name.strip(), arguments=args, id=call_id if isinstance(call_id, str) else None)


def parse_qwen(text: str) -> tuple[list[ToolCall], list[ToolResult]]:
    """Qwen2.5-style <tool_call>{json}</tool_call> blocks, in order; an unclosed last block is malformed."""
    calls, bad = [], []
    for k, m in enumerate(_BLOCK.finditer(text)):
        where = f"tool call {k + 1}"
        if not m.group(0).endswith(CLOSE):
            bad.append(malformed(f"{where} is not closed with {CLOSE}"))
            continue
        try:
            obj = json.loads(m.group(1).strip())
        except json.JSONDecodeError as e:
            bad.append(malformed(f"{where} is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        out = check_call(obj, where)
        (calls if isinstance(out, ToolCall) else bad).append(out)
    return calls, bad


def parse_with_template(tokenizer, text: str, prefix: str, schemas: list[dict]
                        ) -> tuple[list[ToolCall], list[ToolResult]]:
    """transformers' response parsing (tokenizer.response_template); its failure is one malformed result."""
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=schemas or None)
    except (ValueError, TypeError, KeyError) as e:  # what the parser raises on a region it cannot read
        return [], [malformed(str(e))]
    calls, bad = [], []
    for k, obj in enumerate((message or {}).get("tool_calls") or []):
        out = check_call(obj, f"tool call {k + 1}")
        (calls if isinstance(out, ToolCall) else bad).append(out)
    return calls, bad

