"""TRL 1.16's reward semantics (issue 39): environment rewards (get_reward(), named after the class, weight 1, the
only reward when reward_fns is not given), async rewards, the trainer_state / log_extra / log_metric keywords, and
all-None completions (NaN, out of the group's baseline, advantage 0; checked against a float64 re-derivation)."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from common.config import GRPOConfig
from trainer.data.loading import Example
from trainer.objective.grpo import group_advantages, has_spread
from trainer.rewards.scoring import RewardScorer
from trainer.rollout import round_advantages

HERE = Path(__file__).resolve().parent
MOD = "env_rewards_user"  # a name no other test module uses (sys.modules caches it per process)


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    shutil.copy(HERE / "tools_user_code.py", tmp_path / f"{MOD}.py")
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    return tmp_path


def test_reward_sources_follow_trl(user_dir):
    env = f"{MOD}.py:Counter"
    cfg = GRPOConfig(environment_factory=env).validate()  # reward_fns not given: the environment's alone
    assert cfg.reward_specs() == [] and cfg.env_reward_names() == ["Counter"]
    cfg = GRPOConfig(environment_factory=env, reward_fns=[]).validate()  # TRL: reward_funcs may be empty
    assert cfg.reward_specs() == []
    assert GRPOConfig(environment_factory=env, reward_fns=["format"]).validate().reward_specs() == ["format"]
    plain = GRPOConfig(environment_factory=f"{MOD}.py:Plain").validate()
    assert plain.reward_specs() == ["correct", "format"] and plain.env_reward_names() == []
    for kw in ({}, {"environment_factory": f"{MOD}.py:Plain"}):  # nothing gives a reward: refused, one line
        with pytest.raises(ValueError, match="reward_fns is empty and nothing else gives a reward") as e:
            GRPOConfig(reward_fns=[], **kw).validate()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("timeout", [0, 5])  # in this process, and in the reward worker process
def test_env_reward_async_state_and_logging(timeout):
    s = RewardScorer(["trl_rewards:async_len", "trl_rewards:curriculum"], timeout=timeout, env_names=["Counter"])
    try:
        assert s.names == ["async_len", "curriculum", "Counter"]
        s.set_state(global_step=3, max_steps=10, epoch=0.5)
        ex = Example(prompt="p", ground_truth="1")
        env = [{"Counter": 2.0}, {"Other": 1.0}]  # the second rollout's environment is another class
        sc = s.score_group(ex, ["ab", "abcd"], env_rewards=env)
    finally:
        s.close()
    assert sc.components == {"async_len": [2.0, 4.0], "curriculum": [3.0, 3.0], "Counter": [2.0, None]}
    assert sc.rewards == [2.0 + 3.0 + 2.0, 4.0 + 3.0]  # weight 1 for the environment's reward
    assert sc.logged == {"state": ["3/10", "3/10"]} and sc.metrics == {"curriculum_step": [3.0]}


def test_only_an_env_reward_needs_no_reward_worker():
    s = RewardScorer([], timeout=5, env_names=["Counter"])
    sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b"], env_rewards=[{"Counter": 1.0}, None])
    assert s.caller.__class__.__name__ == "InProcessCaller"
    assert sc.components == {"Counter": [1.0, None]} and sc.rewards[0] == 1.0 and math.isnan(sc.rewards[1])
    with pytest.raises(ValueError, match="no reward source"):
        RewardScorer([], timeout=0)


def test_all_none_is_nan():
    s = RewardScorer(["trl_rewards:none_on_marker"], timeout=0)
    sc = s.score_group(Example(prompt="p", ground_truth="1"), ["YES", "NONE", "no"])
    assert sc.rewards[0] == 1.0 and math.isnan(sc.rewards[1]) and sc.rewards[2] == 0.0


def _reference(rewards: list[float], mode: str) -> list[float]:
    """float64, by hand: the scored completions' mean and (n-1) std; unscorable ones get 0 (TRL's nanmean,
    nanstd, nan_to_num)."""
    scored = [r for r in rewards if not math.isnan(r)]
    n = len(scored)
    mean = sum(scored) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (n - 1))
    out = []
    for r in rewards:
        if math.isnan(r):
            out.append(0.0)
        elif mode == "grpo":
            out.append((r - mean) / (std + 1e-4))
        elif mode == "grpo_no_std":
            out.append(r - mean)
        else:
            out.append(r)
    return out


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "raw"])
def test_all_none_completions_leave_the_baseline(mode):
    rewards = [1.0, math.nan, 0.25, 0.0, math.nan, 2.0]
    adv = group_advantages(torch.tensor(rewards), mode)
    torch.testing.assert_close(adv.double(), torch.tensor(_reference(rewards, mode), dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert adv[1] == 0 and adv[4] == 0
    assert has_spread(torch.tensor(rewards)) and not has_spread(torch.tensor([1.0, math.nan, 1.0]))


def test_batch_std_leaves_unscorable_out():
    groups = [torch.tensor([1.0, math.nan, 0.0]), torch.tensor([2.0, 0.5, math.nan])]
    scored = [1.0, 0.0, 2.0, 0.5]
    m = sum(scored) / 4
    std = math.sqrt(sum((r - m) ** 2 for r in scored) / 3)
    want = [[(1.0 - 0.5) / (std + 1e-4), 0.0, (0.0 - 0.5) / (std + 1e-4)],
            [(2.0 - 1.25) / (std + 1e-4), (0.5 - 1.25) / (std + 1e-4), 0.0]]
    for got, w in zip(round_advantages(groups, "grpo_batch_std"), want):
        torch.testing.assert_close(got.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("timeout", [0, 5])
def test_async_rewards_are_gathered_and_one_that_raises_is_named(timeout):
    """TRL runs the async rewards of a batch concurrently (asyncio.gather): each sees the other running."""
    s = RewardScorer(["trl_rewards:meet_a", "trl_rewards:digit_reward", "trl_rewards:meet_b"], timeout=timeout)
    try:
        sc = s.score_group(Example(prompt="p", ground_truth="1"), ["1", "a"])
    finally:
        s.close()
    assert sc.components["meet_a"] == [1.0, 1.0] and sc.components["meet_b"] == [1.0, 1.0]
    s = RewardScorer(["trl_rewards:meet_a", "trl_rewards:async_raises"], timeout=timeout)
    try:
        with pytest.raises(RuntimeError, match=r"'async_raises' failed on row .*: KeyError"):
            s.score_group(Example(prompt="p", ground_truth="1"), ["1"])
    finally:
        s.close()
