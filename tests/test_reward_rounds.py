"""Rewards called as TRL 1.16 calls them (issue 60): each reward function once per generation round (a producer's
batch of groups; TRL: once per generation batch), not once per group; log_metric values of every generated round
reach a trained batch (TRL's _pending_metrics), rounds that trained nothing included; reward_timeout stays one
function's time on one group (a round's call gets it per group); reward_mean / reward_std as TRL's nanmean / nanstd
(unscorable completions left out, not counted as 0); a reward None on every completion is absent, not 0."""
from __future__ import annotations

import pytest
import torch
from test_ref_server import make_batch

from common.config import GRPOConfig
from common.modeling import eos_ids, load_model, load_tokenizer
from common.wire.protocol import collate
from trainer.data.loading import Example, load_examples
from trainer.engines.hf import HFEngine
from trainer.rewards.scoring import Group, RewardScorer
from trainer.rollout import generate_batches
from trainer.run.step_metrics import batch_metrics, reward_logged_metrics, reward_stats, scored_rewards

CALLS: list[int] = []  # completions per call of `by_prompt`
SPREAD = {"on": False}


def by_prompt(prompts, completions, log_metric, log_extra, **kwargs):
    """Spread (0, 1, 0, 1) on the round's first prompt while SPREAD is on, 1.0 everywhere else."""
    CALLS.append(len(completions))
    log_metric("calls", float(len(CALLS)))
    log_extra("call_size", [len(completions)] * len(completions))
    return [float(k % 2) if SPREAD["on"] and p == prompts[0] else 1.0 for k, p in enumerate(prompts)]


def test_one_call_per_round_and_log_metric_of_every_round(tiny_model_dir):
    tok, model = load_tokenizer(str(tiny_model_dir)), load_model(str(tiny_model_dir))
    examples = load_examples("arith", limit=2)
    cfg = GRPOConfig(num_pre_Q=4, max_new_tokens=4, system_prompt="", max_prompt_length=256, gen_batch_size=8,
                     advantage_mode="grpo", compute_gen_logps=False)
    engine = HFEngine(model, tok, eos_ids(tok, model), temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=8)
    scorer = RewardScorer(["test_reward_rounds:by_prompt"], timeout=0)
    CALLS.clear()
    nothing, _ = generate_batches(engine, tok, examples, cfg, scorer)  # no spread: nothing trained this round
    SPREAD["on"] = True
    try:
        trained, st = generate_batches(engine, tok, examples, cfg, scorer)
    finally:
        SPREAD["on"] = False
    assert CALLS == [8, 8]  # both groups of a round in one call (per group: [4, 4, 4, 4])
    assert nothing == [] and len(trained) == 1 and st.skipped_no_spread == 1
    # the first round's log_metric waited for a batch to carry it; the second's came with it
    [entry] = trained[0].extra["round_metrics"]
    assert entry["metrics"] == {"calls": [1.0, 2.0]}
    assert trained[0].extra["logged"] == {"call_size": [8] * 4}  # log_extra split into the call's groups
    assert scorer.pending_metrics == {}
    # a round's batches all carry its values under its id: a step counts them once (after collate too)
    twice = collate([trained[0], trained[0]])
    assert reward_logged_metrics([twice], {}) == {"calls": 1.5}


def test_reward_timeout_is_per_group_of_the_call():
    """reward_timeout 1 s, a TRL-style call of 1.3 s: over two groups it has 2 s and counts; over one it times out."""
    s = RewardScorer(["trl_rewards:slow_batch"], timeout=1.0)
    ex = Example(prompt="p", ground_truth="1")
    try:
        two = s.score_round([Group(ex, ["a", "b"]), Group(ex, ["c", "d"])])
        assert [g.components["slow_batch"] for g in two.groups] == [[1.0, 1.0], [1.0, 1.0]]
        assert [g.timeouts for g in two.groups] == [0, 0]
        one = s.score_round([Group(ex, ["a", "b"])])
        assert one.groups[0].components["slow_batch"] == [None, None] and one.groups[0].timeouts == 1
    finally:
        s.close()


def test_reward_mean_leaves_unscorable_completions_out_and_all_none_is_absent():
    b = make_batch([3, 3, 3], [2, 2, 2])
    b.rewards = torch.tensor([1.0, 0.0, 3.0])  # the middle one unscorable: NaN in TRL, 0 on the wire
    b.extra = {"components": {"f": [1.0, None, 3.0], "never": [None, None, None]}}
    m = batch_metrics(b)
    assert scored_rewards(b) == [1.0, 3.0] and m["reward_mean"] == 2.0  # TRL's nanmean (today: 4/3)
    assert m["reward_std"] == pytest.approx(2 ** 0.5) and m["reward/f"] == 2.0
    assert "reward/never" not in m  # None on every row: absent, not 0
    assert reward_stats([]) == {}  # nothing scored: no reward_mean at all
