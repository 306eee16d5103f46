"""The `extra` metadata keys of a batch that code reads, checked where a batch is decoded (a bad upload is a
400 to its producer, a bad scored batch is rejected by the trainer) and before encoding.

Per-completion lists must have one entry per row: `truncated` (bools; mask_truncated reads it),
`overlong_penalty` (numbers), each `components` list (numbers or null) and each `tools` list (numbers: a tool
run's per-completion statistics). On the wire `extra` also carries the batch's control fields, which decoding
moves to typed fields of the batch (common/wire/batch.py) and check_control checks: `logp_temperature` (a number
> 0) is the temperature of the batch's logprobs, which the ref server uses for ref_logps; `needs_ref` (bool)
false tells the ref server to skip the reference forward (beta = 0).
"""
from __future__ import annotations

import math


class ExtraError(ValueError):
    """extra does not fit its batch (common/wire/limits.py turns it into a ProtocolError)."""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_extra(extra: dict, rows: int) -> None:
    def per_row(key: str, values, ok, what: str) -> None:
        if not isinstance(values, list) or len(values) != rows:
            n = len(values) if isinstance(values, list) else type(values).__name__
            raise ExtraError(f"extra[{key!r}] must be a list of {rows} {what} (one per completion), got {n}")
        if not all(ok(v) for v in values):
            raise ExtraError(f"extra[{key!r}] must hold {what}")

    if "truncated" in extra:
        per_row("truncated", extra["truncated"], lambda v: isinstance(v, bool), "booleans")
    if "overlong_penalty" in extra:
        per_row("overlong_penalty", extra["overlong_penalty"], _number, "numbers")
    if "components" in extra:
        comps = extra["components"]
        if not isinstance(comps, dict):
            raise ExtraError("extra['components'] must be an object {reward name: [value per completion]}")
        for name, vals in comps.items():
            per_row(f"components.{name}", vals, lambda v: v is None or _number(v), "numbers or null")
    if "tools" in extra:  # a tool run's per-completion statistics (trainer/tools/multi_turn.py): the tools/... metrics
        tools = extra["tools"]
        if not isinstance(tools, dict):
            raise ExtraError("extra['tools'] must be an object {statistic: [number per completion]}")
        for name, vals in tools.items():
            per_row(f"tools.{name}", vals, _number, "numbers")
    if "messages" in extra:  # a tool run: each completion as its messages, as the rewards got it (completions.jsonl)
        per_row("messages", extra["messages"], lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v),
                "message lists")
    if "agent" in extra:  # an agent run's per-batch counts (trainer/rollout.py): the agent/... metrics
        agent = extra["agent"]
        if not isinstance(agent, dict) or not all(isinstance(v, list) and all(_number(x) for x in v)
                                                  for v in agent.values()):
            raise ExtraError("extra['agent'] must be an object {count: [number per batch]}")
    if "agent_faults" in extra and not (isinstance(extra["agent_faults"], list)
                                        and all(_number(x) for x in extra["agent_faults"])):
        raise ExtraError("extra['agent_faults'] must be a list of numbers (per batch)")


def check_control(needs_ref, logp_temperature) -> None:
    """The batch's control fields (common/wire/batch.py; `extra` keys on the wire)."""
    if not (_number(logp_temperature) and logp_temperature > 0):
        raise ExtraError(f"extra['logp_temperature'] must be a number > 0, got {logp_temperature!r}")
    if not isinstance(needs_ref, bool):
        raise ExtraError(f"extra['needs_ref'] must be true or false, got {needs_ref!r}")
