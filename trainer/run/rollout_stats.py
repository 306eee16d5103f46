"""What a generation round did, as one typed object (trainer/rollout.py fills it): groups made and skipped,
completions, tokens and seconds, rewards per completion, tool and agent counts. `merge` is the one way two
combine: a rank's rounds of a step (trainer/batches.py), a step's fetches (trainer/run/step_report.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class RolloutStats:
    groups: int = 0
    skipped_no_spread: int = 0
    skipped_long_prompt: int = 0
    reward_timeouts: int = 0
    completions: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    rewards: list = field(default_factory=list)
    components: dict = field(default_factory=dict)
    tools: dict = field(default_factory=dict)  # tool run: per-completion statistics (trainer/tools/multi_turn.py)
    agent_faults: int = 0  # agent run: rollouts whose agent raised, timed out or never called (reward None)
    skipped_samples: list = field(default_factory=list)  # a few (completion, {reward: value}) of skipped groups

    def merge(self, other: RolloutStats) -> RolloutStats:
        """Add another round's statistics into these, the one way they combine (a rank's rounds of a step, a
        step's fetches): counts and seconds summed, per-completion lists joined, the two newest skipped samples
        kept."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine.setdefault(k, []).extend(v)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, f.name, mine + theirs)
        del self.skipped_samples[:-2]
        return self
