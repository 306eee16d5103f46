"""RolloutStats merge one way (issue 64): a rank's rounds of a step (trainer/batches.py), the step's fetches
(trainer/run/step_report.py round_info) and nothing dropped on the way."""
from __future__ import annotations

import dataclasses

from trainer.rollout import RolloutStats
from trainer.run.step_report import round_info


def _stats(seed: int) -> RolloutStats:
    return RolloutStats(groups=2 + seed, skipped_no_spread=seed, skipped_long_prompt=1, reward_timeouts=seed,
                        completions=16, completion_tokens=100 + seed, seconds=0.5, rewards=[float(seed)] * 2,
                        components={"correct": [seed, None]}, tools={"calls": [1, seed]}, agent_faults=seed,
                        skipped_samples=[(f"c{seed}a", {}), (f"c{seed}b", {})])


def test_merge_sums_counts_and_joins_lists():
    a = _stats(1).merge(_stats(2))
    assert (a.groups, a.skipped_no_spread, a.reward_timeouts, a.completion_tokens, a.agent_faults) == (7, 3, 3, 203, 3)
    assert a.seconds == 1.0 and a.rewards == [1.0, 1.0, 2.0, 2.0]
    assert a.components == {"correct": [1, None, 2, None]} and a.tools == {"calls": [1, 1, 1, 2]}
    assert [s[0] for s in a.skipped_samples] == ["c2a", "c2b"]  # the newest two
    every = {f.name for f in dataclasses.fields(RolloutStats)}  # a new field must merge too: none left at default
    assert {n for n in every if getattr(a, n) == getattr(RolloutStats(), n)} == set()


def test_round_info_keeps_the_ranks_own_tool_statistics():
    """round_info summed only the numbers: a rank's own tool calls never reached its /status totals."""
    info = {"wait_s": 1.0, "gen_s": 2.0, "rejected_batches": 0, "dropped_stale": 1, "lost_batches": 0}
    got = round_info([{**info, "own_gen": _stats(1)}, {**info, "own_gen": _stats(2)}])
    assert got["wait_s"] == 2.0 and got["dropped_stale"] == 2
    own = got["own_gen"]
    assert own.skipped_no_spread == 3 and own.agent_faults == 3 and own.tools == {"calls": [1, 1, 1, 2]}
