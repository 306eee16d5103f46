"""TRL 1.16's reward semantics (issue 39): environment rewards (get_reward(), named after the class, weight 1, the
only reward when reward_fns is not given), async rewards, the trainer_state / log_extra / log_metric keywords, and
all-None completions (NaN, out of the group's baseline, advantage 0; checked against a float64 re-derivation)."""
from __future__ import annotations

import math
import re
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
    shutil.copy(HERE / "env_state_user.py", tmp_path / "env_state_user.py")
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


@pytest.mark.parametrize("timeout", [0, 5])  # in this process, and in the reward worker process
def test_async_rewards_keep_their_loop_bound_clients_across_calls(timeout):
    """TRL runs async rewards on one persistent loop: a reward holding a loop-bound object (an AsyncOpenAI /
    httpx.AsyncClient in a judge; an asyncio.Queue here) works on its second call, not only its first."""
    s = RewardScorer(["trl_rewards:queued_len", "trl_rewards:queued_ours"], timeout=timeout)
    try:
        for k in range(3):  # a new loop per call failed here on the second: "bound to a different event loop"
            sc = s.score_group(Example(prompt="p", ground_truth="1"), ["ab", "abc" * (k + 1)])
            assert sc.components == {"queued_len": [2.0, 3.0 * (k + 1)], "queued_ours": [2.0, 3.0 * (k + 1)]}
    finally:
        s.close()


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


def _episode_copies(env: str, calls: dict | None = None) -> list[dict]:
    """Three episodes of `env` (starts 1, 2, 3), the tool calls {episode: amount}, then TRL's `environments`
    copies as the tool loop takes them (after the last turn, before the episodes end)."""
    from trainer.tools import ToolBox
    from trainer.tools.schemas import load_tools
    from trainer.tools.types import ToolCall

    box = ToolBox(load_tools([], env), env, timeout=5.0, output_chars=100)
    try:
        ids = box.start_episodes(3, [{"start": k} for k in (1, 2, 3)])
        box.run([(ids[k], [ToolCall("add", {"amount": a})]) for k, a in (calls or {}).items()])
        copies = box.episode_snapshots(ids)
        box.end_episodes(ids)
    finally:
        box.close()
    return copies


@pytest.mark.parametrize("timeout", [0, 5])  # in this process, and in the reward worker process
def test_environments_are_each_episodes_instance_as_it_ended(user_dir, timeout):
    """TRL passes every reward `environments`: one instance per completion, in the state its episode left it (here
    a copy from the tool executor); to a function that names it and to one that takes **kwargs."""
    copies = _episode_copies(f"{MOD}.py:Counter", {0: 10})
    s = RewardScorer(["trl_rewards:env_value", "trl_rewards:env_seen"], timeout=timeout, env_names=["Counter"],
                     environments=True)
    try:
        assert s.wants_environments
        sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b", "c"],
                           env_rewards=[{"Counter": 11.0}, {"Counter": 2.0}, {"Counter": 3.0}], environments=copies)
    finally:
        s.close()
    assert sc.components["env_value"] == [11.0, 2.0, 3.0] == sc.components["Counter"]
    assert sc.components["env_seen"] == [1.0, 1.0, 1.0] and sc.logged == {"env_class": ["Counter"] * 3}


def test_a_lost_environment_is_not_applicable_for_that_completion(user_dir):
    """An instance gone with a restarted tool process (or whose reset failed): the function is called on the other
    completions, and says None for that one (as get_reward() does), never gets a None instance."""
    from trainer.rewards.environments import lost

    copies = _episode_copies(f"{MOD}.py:Counter", {2: 5})
    copies[1] = lost(copies[1]["spec"], "the rollout's environment is gone")
    s = RewardScorer(["trl_rewards:env_value"], timeout=0, environments=True)
    sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b", "c"], environments=copies)
    assert sc.components["env_value"] == [1.0, None, 8.0] and sc.logged == {"env_class": ["Counter", None, "Counter"]}
    every = [lost(c["spec"], "gone") for c in copies]
    sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b", "c"], environments=every)
    assert sc.components["env_value"] == [None] * 3 and all(math.isnan(r) for r in sc.rewards)


def test_environments_without_an_environment_factory_are_refused_in_one_line(user_dir):
    """A reward that names `environments` cannot be honoured without environment instances: refused when the
    scorer is built (launch.sh check, every producer's start), in one line; a **kwargs one runs without it."""
    for make in (lambda: RewardScorer(["trl_rewards:env_value"], timeout=0),
                 lambda: RewardScorer.from_config(GRPOConfig(reward_fns=["trl_rewards:env_value"]).validate())):
        with pytest.raises(ValueError, match="'env_value' takes `environments`.*no environment_factory") as e:
            make()
        assert "\n" not in str(e.value)
    s = RewardScorer(["trl_rewards:env_seen"], timeout=0)
    assert not s.wants_environments
    assert s.score_group(Example(prompt="p", ground_truth=None), ["a"]).components["env_seen"] == [-1.0]
    cfg = GRPOConfig(reward_fns=["trl_rewards:env_seen"], environment_factory=f"{MOD}.py:Counter").validate()
    assert RewardScorer.from_config(cfg).wants_environments  # TRL passes **kwargs functions `environments` too


@pytest.mark.parametrize("timeout", [0, 5])  # in this process, and in the reward worker process
@pytest.mark.parametrize("cls", ["Rich", "Slotted", "Custom"])
def test_environment_state_crosses_as_json(user_dir, timeout, cls):
    """The copies are the instances' states as strict JSON, rebuilt in the reward's process from the class spec:
    typical state (nested lists, dicts with non-str keys, tuples, sets, nan, bytes, numpy), __slots__, and a class
    with its own __getstate__/__setstate__ come back with their values and exact types (each class checks its own)."""
    import json

    copies = _episode_copies(f"env_state_user.py:{cls}")
    assert all(set(c) == {"spec", "state"} for c in copies), copies
    assert json.loads(json.dumps(copies, allow_nan=False)) == copies  # plain JSON: no pickle, no NaN literal
    s = RewardScorer(["trl_rewards:env_state_ok", "trl_rewards:env_value"], timeout=timeout, environments=True)
    try:
        sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b", "c"], environments=copies)
    finally:
        s.close()
    assert sc.components == {"env_state_ok": [1.0] * 3, "env_value": [1.0, 2.0, 3.0]}


def test_a_reward_changes_only_its_own_copies(user_dir):
    """What a reward does to its copies reaches neither the next function's copies, nor the same copies scored
    again, nor the executor's live instances (their get_reward() and a fresh copy)."""
    from trainer.tools import ToolBox
    from trainer.tools.schemas import load_tools

    env = f"{MOD}.py:Counter"
    box = ToolBox(load_tools([], env), env, timeout=5.0, output_chars=100)
    try:
        ids = box.start_episodes(2, [{"start": 1}, {"start": 2}])
        copies = box.episode_snapshots(ids)
        s = RewardScorer(["trl_rewards:env_bump", "trl_rewards:env_value"], timeout=0, environments=True)
        for _ in range(2):
            sc = s.score_group(Example(prompt="p", ground_truth=None), ["a", "b"], environments=copies)
            assert sc.components == {"env_bump": [101.0, 102.0], "env_value": [1.0, 2.0]}
        assert box.episode_rewards(ids) == [{"Counter": 1.0}, {"Counter": 2.0}]
        assert box.episode_snapshots(ids) == copies
        box.end_episodes(ids)
    finally:
        box.close()


UNCOPYABLE = [(f"{MOD}.py:Locked", "Locked instances cannot be copied to the reward process: Locked.lock is a "
                                   "_thread.lock; keep the state in attributes holding None, bool, int"),
              ("env_state_user.py:Nested", "Nested instances cannot be copied to the reward process: "
                                           "Nested.pieces['king'][1] is a Piece; keep the state in attributes")]


@pytest.mark.parametrize("timeout", [0, 5])
@pytest.mark.parametrize("env,why", UNCOPYABLE, ids=["Locked", "Nested"])
def test_an_environment_that_cannot_be_copied(user_dir, timeout, env, why):
    """A state JSON cannot carry (a lock, an object of another class): a reward naming `environments` stops the run
    in one line naming the class, where the value sits, its type and what to do; one that only takes **kwargs is
    called without it."""
    copies = _episode_copies(env)
    assert all(c["error"].startswith(why) and "__getstate__/__setstate__" in c["error"] and not c["lost"]
               and "\n" not in c["error"] for c in copies), copies
    ex = Example(prompt="p", ground_truth=None)
    s = RewardScorer(["trl_rewards:env_seen"], timeout=timeout, environments=True)
    try:
        assert s.score_group(ex, ["a", "b", "c"], environments=copies).components["env_seen"] == [-1.0] * 3
    finally:
        s.close()
    s = RewardScorer(["trl_rewards:env_value"], timeout=timeout, environments=True)
    try:
        with pytest.raises(RuntimeError, match=r"'env_value' failed on row .*: TypeError: environments\[0\]: "
                                               + re.escape(why)):
            s.score_group(ex, ["a", "b", "c"], environments=copies)
    finally:
        s.close()


def test_rows_without_a_prompt_get_it_from_reset(tmp_path):
    """TRL 1.16 (grpo_trainer.py ~2330-2337, ~2372-2386): with an environment_factory a row may have no prompt: it
    stands as an empty user message, reset() gets the row without it, and what reset() returns is the prompt."""
    import json

    from trainer.data.loading import ColumnSpec, load_examples
    from trainer.rollout import reset_kwargs, with_observation

    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"environment": "maze", "level": 2}) + "\n")
    with pytest.raises(ValueError, match="none of the known layouts"):  # without an environment: as before
        load_examples(str(f))
    ex, = load_examples(str(f), columns=ColumnSpec(environment=True))
    assert ex.prompt == [{"role": "user", "content": ""}] and ex.reset_prompt and ex.ground_truth is None
    assert ex.columns == {"environment": "maze", "level": 2} == reset_kwargs(ex)  # no stand-in `prompt` for reset
    assert with_observation(ex, "Maze 2: go").prompt == [{"role": "user", "content": "Maze 2: go"}]
    with pytest.raises(ValueError, match="no prompt column 'prompt'.*needs prompt_format auto") as e:
        load_examples(str(f), columns=ColumnSpec(environment=True, prompt_format="r1zero"))
    assert "\n" not in str(e.value)
    f.write_text(json.dumps({"prompt": "Go.", "level": 2}) + "\n")
    ex, = load_examples(str(f), columns=ColumnSpec(environment=True))
    assert not ex.reset_prompt and reset_kwargs(ex) == {"prompt": "Go.", "level": 2}
    assert ColumnSpec.from_config(GRPOConfig(environment_factory="x:Y")).environment


def test_reset_gets_the_row_less_the_routing_column(user_dir):
    """TRL: in the dict form `environment` routes the row and is not passed to reset(); one class gets the row."""
    from trainer.tools import ToolBox
    from trainer.tools.schemas import load_tools

    for env, got in (({"e": f"{MOD}.py:Echo"}, "['level']"), (f"{MOD}.py:Echo", "['environment', 'level']")):
        box = ToolBox(load_tools([], env), env, timeout=5.0, output_chars=100)
        try:
            ep, = box.start_episodes(1, [{"environment": "e", "level": 1}])
            assert box.observations[ep] == got
            box.end_episodes([ep])
        finally:
            box.close()


def test_launch_check_scores_environment_rewards_with_copies_and_refuses_in_one_line(user_dir, capsys):
    """`launch.sh check`'s rewards line: rows reset, their instances copied as the tool loop copies them, a reward
    naming `environments` scored on them; a class that cannot be copied, or no environment_factory: one FAIL line."""
    from trainer.check import Checker, check_rewards

    def check(**kw) -> list[str]:
        c = Checker()
        c.cfg = GRPOConfig(reward_fns=["trl_rewards:env_value"], num_pre_Q=2, reward_timeout=0, **kw).validate()
        c.examples = [Example(prompt="p", ground_truth=None, columns={"start": s}) for s in (4, 7)]
        c.run("rewards", lambda: check_rewards(c))
        return capsys.readouterr().out.splitlines()

    assert check(environment_factory=f"{MOD}.py:Counter")[0].startswith(
        "ok   rewards  2 groups of 2 scored: env_value=4..7, Counter=None on all 4")
    out = check(environment_factory=f"{MOD}.py:Locked")
    assert out[0].startswith("FAIL rewards  RuntimeError: reward function 'env_value' failed on row 0") and \
        "environments[0]: " + UNCOPYABLE[0][1] in out[0]
    out = check()
    assert len(out) == 1 and out[0].startswith("FAIL rewards  ValueError: reward function 'env_value' takes "
                                               "`environments` (TRL's environment instances), but no "
                                               "environment_factory is configured")
