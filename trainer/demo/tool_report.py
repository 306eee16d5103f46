"""The tool and agent demos' reports (`./launch.sh demo --tools` / `--agent`): their rows of the before/after table
and their summary.json keys. Apart from tool_phases.py and agent_phases.py because phases.report() calls them, and
those build on phases.py."""
from __future__ import annotations

from collections.abc import Callable


def tool_summary(before: dict, after: dict, without: dict) -> dict:
    """The summary.json keys of the tool demo (issue 32), accuracies as fractions."""
    return {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "tool_calls_per_completion_before": before["tool_calls_per_completion"],
            "tool_calls_per_completion_after": after["tool_calls_per_completion"],
            "accuracy_without_tools": without["accuracy"]}


def before_after(log: Callable[[str], None], title: str, width: int, before: dict, after: dict, rows) -> None:
    """The before/after/change table of both demos' reports: rows of (label, key, as a percentage)."""
    log("")
    log(f"{title:<{width}}{'before':>10}{'after':>10}{'change':>10}")
    for name, key, pct in rows:
        b, f = before[key], after[key]
        if pct:
            log(f"{name:<{width}}{100 * b:>9.1f}%{100 * f:>9.1f}%{100 * (f - b):>+10.1f}")
        else:
            log(f"{name:<{width}}{b:>10.2f}{f:>10.2f}{f - b:>+10.2f}")


def tool_table(log: Callable[[str], None], before: dict, after: dict, without: dict) -> None:
    before_after(log, f"held-out ({before['n']} examples)", 36, before, after, (
        ("accuracy (with the calculator)", "accuracy", True),
        ("tool calls per completion", "tool_calls_per_completion", False),
        ("  accuracy when it calls", "accuracy_with_call", True), ("  accuracy by itself", "accuracy_own", True)))
    log(f"{'accuracy without tools (SFT model)':<36}{100 * without['accuracy']:>9.1f}%")


def agent_summary(before: dict, after: dict) -> dict:
    """summary.json's keys of the agent demo, accuracies as fractions (the GRPO-phase counts are metrics.jsonl's)."""
    return {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "tool_calls_per_completion_before": before["tool_calls_per_completion"],
            "tool_calls_per_completion_after": after["tool_calls_per_completion"],
            "calls_per_rollout_before": before["calls_per_rollout"],
            "calls_per_rollout_after": after["calls_per_rollout"]}


def agent_table(log, before: dict, after: dict) -> None:
    before_after(log, f"held-out ({before['n']} examples, the agent)", 40, before, after, (
        ("accuracy", "accuracy", True), ("endpoint calls per rollout", "calls_per_rollout", False),
        ("tool calls per completion", "tool_calls_per_completion", False),
        ("  accuracy when it calls", "accuracy_with_call", True), ("  accuracy by itself", "accuracy_own", True)))
