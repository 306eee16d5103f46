"""Say so when nothing trains: cumulative rollout counts, logged every `every` seconds of no progress.

A weak model on a hard task can sample only equal-reward groups (all -2): every group is skipped for
lack of spread, no batch is ever uploaded and the run would sit at step 0 without a word.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger("trainer")


class StallReporter:
    """Counts since start; `maybe_log` warns while no batch was produced/trained for `every` seconds."""

    def __init__(self, who: str, every: float = 30.0, clock=time.monotonic) -> None:
        self.who, self.every, self.clock = who, every, clock
        self.groups = self.skipped = self.produced = 0
        self.rewards: Counter = Counter()
        self.last_progress = self.last_log = clock()

    def add(self, stats, produced: int) -> None:
        """One generation round's RolloutStats and how many batches it yielded."""
        self.groups += stats.groups
        self.skipped += stats.skipped_no_spread
        self.rewards.update(round(float(r), 4) for r in stats.rewards)
        self.produced += produced
        if produced:
            self.progress()

    def progress(self) -> None:
        self.last_progress = self.clock()

    def maybe_log(self) -> str | None:
        now = self.clock()
        if now - max(self.last_progress, self.last_log) < self.every:
            return None
        self.last_log = now
        seen = ", ".join(f"{r:g}: {n}" for r, n in sorted(self.rewards.most_common(8)))
        msg = (f"{self.who}: nothing to train on for {now - self.last_progress:.0f} s; so far {self.groups} groups "
               f"sampled, {self.skipped} skipped for no reward spread, {self.produced} batches produced; rewards "
               f"seen {{{seen}}}. Equal rewards in a group give no signal: set train_zero_spread=true to train "
               f"on them anyway (their loss is the KL term alone), or use an easier task/stronger model.")
        log.warning(msg)
        return msg
