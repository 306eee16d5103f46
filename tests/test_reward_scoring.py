"""Reward scoring: both signatures, None, weights, hard errors, and the per-call timeout (issue 13 / 16)."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_rewards, loaded by dotted path

from trainer.data.loading import Example  # noqa: E402
from trainer.rewards.scoring import RewardScorer, reward_kind  # noqa: E402


def ex(gt: str = "4", prompt: str = "2+2?", **cols) -> Example:
    return Example(prompt=prompt, ground_truth=gt, columns={"ground_truth": gt, **cols})


@pytest.mark.parametrize("timeout", [0, 5.0])
def test_ours_and_trl_together_with_weights_and_none(timeout):
    s = RewardScorer(["contains", "trl_rewards:digit_reward", "trl_rewards:exact_answer"], [2.0, 1.0, 0.5],
                     timeout=timeout)
    try:
        assert s.kinds == ["ours", "trl", "trl"]
        sc = s.score_group(ex("4"), ["4", "ab", "x4"])
        assert sc.components["contains"] == [1.0, 0.0, 1.0]
        assert sc.components["digit_reward"] == [1.0, 0.0, 0.5]
        assert sc.components["exact_answer"] == [1.0, 0.0, 0.0]
        assert sc.rewards == pytest.approx([2 + 1 + 0.5, 0.0, 2 + 0.5])
        skip = s.score_group(ex("skip"), ["skip", "4"])  # None: left out of the sum, as TRL does
        assert skip.components["exact_answer"] == [None, None]
        assert skip.rewards == pytest.approx([2.0, 1.0]) and skip.timeouts == 0
    finally:
        s.close()


def test_messages_runs_get_message_completions():
    s = RewardScorer(["trl_rewards:digit_reward"], timeout=0, conversational=True)
    seen = {}

    def spy(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions, kw=kw)
        return [0.0] * len(completions)

    s.fns[0] = s.caller.fns[0] = spy
    conv = [{"role": "user", "content": "hi"}]
    s.score_group(Example(prompt=conv, ground_truth="1", columns={"ground_truth": "1", "level": 3}), ["12", "a"],
                  [[5, 6], [7]])
    assert seen["prompts"] == [conv, conv]
    assert seen["completions"] == [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "a"}]]
    kw = {k: v for k, v in seen["kw"].items() if k not in ("trainer_state", "log_extra", "log_metric")}  # TRL's
    assert kw == {"ground_truth": ["1", "1"], "level": [3, 3], "completion_ids": [[5, 6], [7]]}


def test_signature_detection():
    assert reward_kind(lambda completion, ground_truth: 0.0, "f") == "ours"
    assert reward_kind(lambda prompts, completions, **kw: [], "f") == "trl"
    assert reward_kind(lambda **kw: [], "f") == "trl"
    with pytest.raises(ValueError, match=r"neither.*fn\(completion: str, ground_truth: str\).*fn\(prompts, "):
        RewardScorer(["trl_rewards:neither"], timeout=0)


@pytest.mark.parametrize("timeout", [0, 5.0])
@pytest.mark.parametrize("fn, why", [("trl_rewards:wrong_length", "returned 1 values for 2 completions"),
                                     ("trl_rewards:raises", "KeyError")])
def test_bad_reward_stops_with_name_and_example(fn, why, timeout):
    s = RewardScorer([fn], timeout=timeout)
    try:
        with pytest.raises(RuntimeError, match=why) as e:
            s.score_group(ex("4", prompt="What is 2+2?"), ["a", "b"])
        assert fn.split(":")[1] in str(e.value) and "What is 2+2?" in str(e.value)
    finally:
        s.close()


def test_nan_is_an_error():
    s = RewardScorer(["trl_rewards:digit_reward"], timeout=0)
    s.fns[0] = s.caller.fns[0] = lambda prompts, completions, **kw: [math.nan] * len(completions)
    with pytest.raises(RuntimeError, match="nan"):
        s.score_group(ex(), ["a"])


def test_weights_must_match():
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        RewardScorer(["contains", "format"], [1.0], timeout=0)


def test_timeout_one_hanging_answer_costs_one_timeout():
    """A reward that sleeps forever on one answer: the group is scored, that completion is None, counted once,
    and the call takes about one timeout (not one per remaining completion), with the worker reused after."""
    s = RewardScorer(["trl_rewards:hang_on_answer", "contains"], timeout=1.0)
    try:
        s.score_group(ex("4"), ["warm-up"])  # start the worker outside the timed part
        t0 = time.monotonic()
        sc = s.score_group(ex("4"), ["4", "HANG", "x", "4"])
        took = time.monotonic() - t0
        assert sc.components["hang_on_answer"] == [1.0, None, 0.0, 1.0]
        assert sc.timeouts == 1 and sc.timed_out == {"hang_on_answer": [1]}
        assert sc.rewards == [2.0, 0.0, 0.0, 2.0]  # the other function still counts for the hung completion
        assert 1.0 <= took < 1.0 + 5.0  # one timeout plus a worker restart, not 2+ timeouts
        t0 = time.monotonic()
        again = s.score_group(ex("4"), ["4"] * 8)
        assert again.timeouts == 0 and time.monotonic() - t0 < 1.0  # the restarted worker is reused
        assert s.caller.timeouts == 1
    finally:
        s.close()


def test_batch_function_timeout_is_not_applicable_for_its_group():
    s = RewardScorer(["trl_rewards:hang_on_marker", "trl_rewards:digit_reward"], timeout=1.0)
    try:
        sc = s.score_group(ex("hang"), ["1", "a"])
        assert sc.components["hang_on_marker"] == [None, None] and sc.timeouts == 1
        assert sc.rewards == [1.0, 0.0]
        assert s.score_group(ex("4"), ["1"]).components["hang_on_marker"] == [0.0]
    finally:
        s.close()


def test_timeout_works_off_the_main_thread():
    import threading

    out = {}
    s = RewardScorer(["trl_rewards:hang_on_answer"], timeout=1.0)

    def run():
        out["sc"] = s.score_group(ex("4"), ["HANG", "4"])

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    s.close()
    assert not t.is_alive() and out["sc"].components["hang_on_answer"] == [None, 1.0]


def test_math_verify_builtin():
    s = RewardScorer(["math_verify"], timeout=0)
    sc = s.score_group(ex("\\frac{1}{2}"), ["<answer>0.5</answer>", "\\boxed{\\frac{2}{4}}", "<answer>3</answer>"])
    assert sc.components["math_verify"] == [1.0, 1.0, -1.0]
