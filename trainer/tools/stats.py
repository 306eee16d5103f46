"""Per-tool counters of a ToolBox, which the rollout loop turns into metrics (ToolBox.stats)."""
from __future__ import annotations

from trainer.tools.types import ToolResult


class ToolStats:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.per_tool: dict[str, dict] = {}
        self.totals = {"calls": 0, "failed": 0, "timed_out": 0, "malformed": 0, "unknown_tool": 0, "seconds": 0.0}

    def add(self, result: ToolResult, known: bool) -> None:
        """Count one result. Only known tools get a per-tool entry (unknown names are the model's inventions)."""
        failed, timed_out = result.status != "ok", result.status == "timeout"
        rows = [self.totals] + ([self.per_tool.setdefault(result.name, {"calls": 0, "failed": 0, "timed_out": 0,
                                                                        "seconds": 0.0})] if known else [])
        for row in rows:
            row["calls"] += 1
            row["failed"] += failed
            row["timed_out"] += timed_out
            row["seconds"] += result.seconds
        if result.status in ("malformed", "unknown_tool"):
            self.totals[result.status] += 1

    def snapshot(self, kills: int) -> dict:
        return {**self.totals, "kills": kills, "per_tool": {k: dict(v) for k, v in self.per_tool.items()}}
