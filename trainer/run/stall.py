"""Say so when nothing trains, and stop what can never train (issue 41).

A weak model on a hard task can sample only equal-reward groups (all -2): every group is skipped for lack of
spread, no batch is ever uploaded and the run would sit at step 0 without a word: a line every `every` seconds says
so, with the rewards seen (None, "not applicable", shown as None, never as 0).

What cannot get better by waiting ends the run (NothingToTrain: one line, exit 7, trainer/main.py):
- `max_skipped_prompts` prompts in a row skipped for length: the line names max_prompt_length;
- the first `none_reward_groups` groups got None from every reward for every completion: the line names the
  rewards. A reward None on all of them while others apply is said once, and the run goes on;
- `max_no_spread_groups` groups in a row, and no batch since, had equal rewards in every group (nothing trains
  under dynamic sampling, train_zero_spread false): exit 8 (NoRewardSpread), the line gives each reward's values.
While nothing trains for lack of spread, `state()` says so: the producer's heartbeat state (launch.sh status).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger("trainer")
EXIT_NOTHING_TO_TRAIN = 7
EXIT_NO_REWARD_SPREAD = 8


class NothingToTrain(RuntimeError):
    """A producer that can never make a batch: its one line names the knob or the rewards (exit 7)."""
    exit_code = EXIT_NOTHING_TO_TRAIN


class NoRewardSpread(NothingToTrain):
    """Every group of max_no_spread_groups in a row had equal rewards: nothing trains (exit 8)."""
    exit_code = EXIT_NO_REWARD_SPREAD


def _values(counter: Counter) -> str:
    """{value: count} of the most common values, None (not applicable) as None, never as 0."""
    top = sorted(counter.most_common(8), key=lambda kv: (kv[0] is not None, kv[0] or 0))
    return "{" + ", ".join(f"{r if r is None else format(r, 'g')}: {n}" for r, n in top) + "}"


def completion_values(stats) -> list[float | None]:
    """Each completion's reward, None where every reward function said None (stats.rewards holds the weighted
    sums, where a completion nothing applied to reads as 0)."""
    comps = list(stats.components.values())
    return [None if comps and all(c[k] is None for c in comps if k < len(c)) else r
            for k, r in enumerate(stats.rewards)]


class StallReporter:
    """Counts since start; `maybe_log` warns while no batch was produced/trained for `every` seconds; `add` raises
    NothingToTrain when the limits above are reached (0 = never)."""

    def __init__(self, who: str, every: float = 30.0, clock=time.monotonic, max_skipped_prompts: int = 0,
                 max_prompt_length: int = 0, none_reward_groups: int = 0, no_spread_groups: int = 0) -> None:
        self.who, self.every, self.clock = who, every, clock
        self.groups = self.skipped = self.produced = 0
        self.long_in_a_row = self.flat_in_a_row = 0
        self.no_spread_groups = no_spread_groups
        self.rewards: Counter = Counter()
        self.by_reward: dict[str, Counter] = {}  # each reward function's values, since start
        self.samples: list = []  # the latest few (completion, {reward: value}) of skipped groups
        self.max_skipped_prompts, self.max_prompt_length = max_skipped_prompts, max_prompt_length
        self.none_reward_groups = none_reward_groups
        self.first: dict[str, list[int]] = {}  # reward -> [values, Nones] over the first none_reward_groups groups
        self.first_groups = 0
        self.last_progress = self.last_log = clock()

    @classmethod
    def from_config(cls, who: str, cfg) -> StallReporter:
        return cls(who, cfg.log_stall_every, max_skipped_prompts=cfg.max_skipped_prompts,
                   max_prompt_length=cfg.max_prompt_length, none_reward_groups=cfg.none_reward_groups,
                   no_spread_groups=0 if cfg.train_zero_spread else cfg.max_no_spread_groups)

    def add(self, stats, produced: int) -> None:
        """One generation round's RolloutStats and how many batches it yielded."""
        self.groups += stats.groups
        self.skipped += stats.skipped_no_spread
        self.rewards.update(None if v is None else round(float(v), 4) for v in completion_values(stats))
        self.produced += produced
        for name, vals in stats.components.items():
            self.by_reward.setdefault(name, Counter()).update(None if v is None else round(float(v), 4) for v in vals)
        self.samples = (self.samples + list(getattr(stats, "skipped_samples", [])))[-2:]
        self.flat_in_a_row = 0 if produced else self.flat_in_a_row + stats.skipped_no_spread
        if produced:
            self.progress()
        if self.no_spread_groups and self.flat_in_a_row >= self.no_spread_groups:
            raise NoRewardSpread(
                f"{self.who}: the last {self.flat_in_a_row} groups sampled all had equal rewards (no spread: zero "
                f"advantages), so nothing trains; {self.reward_values()}. Set train_zero_spread true to train on "
                f"them (TRL's behaviour: the KL term alone), or use an easier task or a stronger model "
                f"(max_no_spread_groups {self.no_spread_groups})")
        self.long_in_a_row = 0 if stats.groups else self.long_in_a_row + getattr(stats, "skipped_long_prompt", 0)
        if self.max_skipped_prompts and self.long_in_a_row >= self.max_skipped_prompts:
            raise NothingToTrain(
                f"{self.who}: the last {self.long_in_a_row} prompts were all skipped: none fits max_prompt_length "
                f"{self.max_prompt_length} tokens as the model sees it (chat template, tools section, reset() text); "
                f"raise max_prompt_length or shorten the prompts (launch.sh check counts them)")
        self._first_groups(stats)

    def _first_groups(self, stats) -> None:
        if not self.none_reward_groups or self.first_groups >= self.none_reward_groups or not stats.groups:
            return
        self.first_groups += stats.groups
        for name, vals in stats.components.items():
            seen = self.first.setdefault(name, [0, 0])
            seen[0] += len(vals)
            seen[1] += sum(v is None for v in vals)
        if self.first_groups < self.none_reward_groups:
            return
        dead = [n for n, (count, nones) in self.first.items() if count and nones == count]
        if dead and len(dead) == len(self.first):
            raise NothingToTrain(
                f"{self.who}: every reward returned None (not applicable) for every completion of the first "
                f"{self.first_groups} groups: {', '.join(dead)}; nothing can train. Check what they expect of the "
                f"completions and the data's columns (none_reward_groups)")
        for name in dead:
            log.warning("%s: reward %r returned None (not applicable) for every completion of the first %d groups; "
                        "the other rewards apply, so the run goes on", self.who, name, self.first_groups)

    def progress(self) -> None:
        self.last_progress = self.clock()
        self.flat_in_a_row = 0

    def reward_values(self) -> str:
        """Each reward function's values so far: `rewards seen: correct {0: 180}, format {0: 180}`."""
        per = "; ".join(f"{name} {_values(c)}" for name, c in self.by_reward.items())
        return f"rewards seen: {per or _values(self.rewards)}"

    def state(self) -> str | None:
        """While no batch came since `flat_in_a_row` groups without spread: what the status view shows."""
        if not self.flat_in_a_row:
            return None
        return f"nothing to train: {self.flat_in_a_row} groups in a row without reward spread"

    def maybe_log(self) -> str | None:
        now = self.clock()
        if now - max(self.last_progress, self.last_log) < self.every:
            return None
        self.last_log = now
        msg = (f"{self.who}: nothing to train on for {now - self.last_progress:.0f} s; so far {self.groups} groups "
               f"sampled, {self.skipped} skipped for no reward spread, {self.produced} batches produced; rewards "
               f"seen {_values(self.rewards)} (summed; None: no reward applied); per reward: "
               f"{self.reward_values().removeprefix('rewards seen: ')}. Equal rewards in a group give no signal: set "
               f"train_zero_spread=true to train on them anyway (their loss is the KL term alone), or use an easier "
               f"task/stronger model.")
        for text, rewards in self.samples:  # what the model writes, and what each reward said of it
            msg += f"\n    skipped: {text[:160]!r} -> " + ", ".join(f"{k} {v}" for k, v in rewards.items())
        log.warning(msg)
        return msg
