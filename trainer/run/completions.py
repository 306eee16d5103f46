"""Sample completions in the run directory (TRL's `log_completions`): what the policy trained on, readable.

Every `log_completions_steps` steps that fetched new batches, every rank decodes the rows it trains on and
rank 0 gathers them, appends one JSON row per completion to RUN_DIR/completions.jsonl, prints
`num_completions_to_print` of them as a table and, with W&B on, logs the same rows as a wandb.Table.
A row: step, prompt (as the model saw it, template included), completion (special tokens stripped, as the
rewards saw it), rewards (function name -> value, null where a function did not apply), reward (their weighted
sum), advantage, policy_version and producer (the worker or rank that generated it). A tool run's rows also have
tokens / model_tokens and `messages`: the completion as TRL logs it and its rewards got it (assistant turns as
TRL's parse_response gives them, `content` without the call markup, the calls in `tool_calls`; the tool turns),
for a group whose messages fit the batch's room on the wire (trainer/tools/multi_turn.py messages_extra). An agent
run's `completion` is its session's conversation after the first request's messages, a list of {role, content,
tool_calls?} (trainer/agents/rollout.py).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from common.wire.protocol import ScoredBatch

log = logging.getLogger("trainer")
COLUMNS = ["step", "prompt", "completion", "rewards", "reward", "advantage", "policy_version", "producer"]


def completion_rows(batches: list[ScoredBatch], tokenizer, step: int) -> list[dict]:
    rows = []
    for b in batches:
        comps = b.extra.get("components", {})
        for i in range(b.num_rows):
            p, c = int(b.prompt_lens[i]), int(b.completion_lens[i])
            ids = b.input_ids[i].tolist()
            rows.append({"step": step, "prompt": tokenizer.decode(ids[:p]),
                         "completion": tokenizer.decode(ids[p:p + c], skip_special_tokens=True),
                         "rewards": {name: vals[i] for name, vals in comps.items()},
                         "reward": None if b.rewards is None else float(b.rewards[i]),
                         "advantage": float(b.advantages[i]), "policy_version": int(b.policy_version),
                         "producer": b.producer_id})
            for column, vals in (b.extra.get("logged") or {}).items():  # TRL's log_extra: one more column
                if len(vals) == b.num_rows and column not in rows[-1]:
                    rows[-1][column] = vals[i]
            if b.loss_mask is not None:  # a tool run: the tokens it trained on (tool turns' are masked)
                rows[-1].update(tokens=c, model_tokens=int(b.loss_mask[i, :c].sum()))
            if len(b.extra.get("messages") or []) == b.num_rows:  # a tool run: the turns as TRL parses them
                rows[-1]["messages"] = b.extra["messages"][i]
            if len(b.extra.get("agent_completion") or []) == b.num_rows:  # an agent run: its conversation
                rows[-1]["completion"] = b.extra["agent_completion"][i]
    return rows


def gather_rows(rows: list[dict]) -> list[dict]:
    """Every rank's rows, in rank order, on every rank (an object collective: every rank calls it)."""
    if not torch.distributed.is_initialized():
        return rows
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, rows)
    return [r for part in parts for r in part]


def _cell(x, width: int) -> str:
    s = " ".join(str(x).split())  # one line
    return s if len(s) <= width else s[:width - 1] + "…"


def table_text(rows: list[dict]) -> str:
    head = f"{'producer':<16} {'reward':>7} {'adv':>7}  completion"
    lines = [head, "-" * len(head)]
    for r in rows:
        reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        lines.append(f"{_cell(r['producer'], 16):<16} {reward:>7} {r['advantage']:>7.3f}  {_cell(r['completion'], 90)}")
    return "\n".join(lines)


class CompletionLog:
    """Rank 0's completions.jsonl. On resume, rows after the restored step are dropped (those steps re-run)."""

    def __init__(self, out_dir: str | Path, resume_step: int | None, to_print: int | None):
        self.path = Path(out_dir) / "completions.jsonl"
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.to_print = to_print

    def log(self, step: int, rows: list[dict], metrics=None) -> None:
        with self.path.open("a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        shown = rows if self.to_print is None else rows[:self.to_print]
        if shown:
            log.info("completions trained at step %d (%d of %d; all in %s):\n%s", step, len(shown), len(rows),
                     self.path.name, table_text(shown))
        if metrics is not None:
            metrics.table(step, "completions", COLUMNS,
                          [[json.dumps(r[c]) if c == "rewards" else r[c] for c in COLUMNS] for r in rows])
