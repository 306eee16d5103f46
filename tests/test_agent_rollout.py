"""An agent round inside generate_batches (trainer/agents/rollout.py, issue 61): the user's agent makes every rollout
against the endpoint, each session becomes training rows (a rewritten history: a segment row sharing its rollout's
reward and advantage), rewards get TRL's conversational signature, the agent's own float is a reward named after it,
faults give reward None, and the config refuses what cannot be honoured."""
from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_rewards, loaded by dotted path

from common.config import GRPOConfig  # noqa: E402
from tests.agent_doubles import ScriptedEngine  # noqa: E402
from tests.tool_doubles import spelled  # noqa: E402
from trainer.agents.rollout import AgentRollouts  # noqa: E402
from trainer.data.loading import Example  # noqa: E402
from trainer.rewards.scoring import RewardScorer  # noqa: E402
from trainer.rollout import generate_batches  # noqa: E402
from trainer.run.completions import completion_rows  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from common.tiny_model import build_tokenizer
    return build_tokenizer()


def solve(base_url, model, prompt, answer):
    """Two calls (an answer, then a follow-up user turn), except: 'raise' raises, 'rewrite' cuts its history."""
    if prompt == "raise":
        raise ValueError("boom")
    client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0)
    msgs = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model=model, messages=msgs)
    if prompt == "rewrite":  # a new history: its own segment, never re-tokenised
        msgs = [{"role": "user", "content": "Start over."}]
    else:
        msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model=model, messages=msgs)
    return 0.5 if prompt == "rewrite" else 1.0


def test_an_agent_round_trains_its_sessions_token_exact(tok):
    answer = spelled(tok, "6") + [tok.eos_token_id]
    engine = ScriptedEngine(tok, [answer])
    cfg = GRPOConfig(model="tiny", num_pre_Q=3, max_new_tokens=50, agent="my_agent.py:solve",
                     reward_fns=["trl_rewards:said_turns"], agent_timeout=30, train_zero_spread=True).validate()
    scorer = RewardScorer.from_config(cfg)
    agents = AgentRollouts(cfg, engine, tok, solve)
    exs = [Example(prompt=p, ground_truth="6", columns={"answer": "6"}, index=i)
           for i, p in enumerate(["2 * 3?", "rewrite"])]
    try:
        batches, stats = generate_batches(engine, tok, exs, cfg, scorer, agents=agents, policy_version=2)
    finally:
        agents.close()
        scorer.close()
    plain, b = batches
    assert plain.num_rows == 3 and plain.extra["components"]["said_turns"] == [12.0] * 3  # one row per session
    served = engine.rec.served()
    assert b.num_rows == 6 and b.loss_mask is not None  # 3 rollouts x 2 segments, each its own row
    for i in range(b.num_rows):
        p, c = int(b.prompt_lens[i]), int(b.completion_lens[i])
        ids, mask = b.input_ids[i, :p + c].tolist(), b.loss_mask[i, :c]
        assert (ids[:p], ids[p:p + c]) in served and mask.all()  # exactly what the engine consumed and sampled
    comps = b.extra["components"]
    assert comps["solve"] == [0.5] * 6 and comps["said_turns"] == [2.0] * 6  # the agent's float, named after it
    assert torch.equal(b.advantages[0::2], b.advantages[1::2])  # a rollout's segment rows share its advantage
    conv = b.extra["agent_completion"]
    assert conv[0] == [{"role": "assistant", "content": "6"}, {"role": "assistant", "content": "6"}]
    rows = completion_rows([b], tok, step=1)
    assert rows[0]["completion"] == conv[0] and rows[0]["rewards"] == {"said_turns": 2.0, "solve": 0.5}


def test_a_follow_up_extends_one_row_and_a_failing_agent_has_no_reward(tok, caplog):
    answer = spelled(tok, "6") + [tok.eos_token_id]
    engine = ScriptedEngine(tok, [answer])
    # max_prompt_length 60: the prompt fits as the agent sends it, not with the R1 system prompt (~100 tokens)
    cfg = GRPOConfig(model="tiny", num_pre_Q=2, max_new_tokens=50, agent="my_agent.py:solve", reward_fns=[],
                     train_zero_spread=True, max_prompt_length=60).validate()
    scorer = RewardScorer.from_config(cfg)
    agents = AgentRollouts(cfg, engine, tok, solve)
    exs = [Example(prompt="2 * 3?", ground_truth="6", columns={"answer": "6"}, index=0),
           Example(prompt="raise", ground_truth="6", columns={"answer": "6"}, index=1)]
    try:
        with caplog.at_level("WARNING", logger="trainer"):
            batches, stats = generate_batches(engine, tok, exs, cfg, scorer, agents=agents)
    finally:
        agents.close()
        scorer.close()
    b, = batches  # the raising prompt's rollouts made no calls: no rows to train
    assert stats.agent_faults == 2  # counted (the worker's /status: agent_faults)
    assert b.num_rows == 2 and b.extra["components"] == {"solve": [1.0, 1.0]}  # reward_fns []: its float alone
    mask = b.loss_mask[0, :int(b.completion_lens[0])].tolist()
    sampled = [i for i, m in enumerate(mask) if m]
    assert len(sampled) == 2 * len(answer) and not all(mask)  # two replies trained, the follow-up turn masked
    assert b.extra["agent_completion"][0] == [{"role": "assistant", "content": "6"},
                                               {"role": "user", "content": "Sure?"},
                                               {"role": "assistant", "content": "6"}]
    assert "agent solve: 2 of 4 rollouts have no reward (None): rollout 2 (row 1): raised ValueError: boom" \
        in caplog.text
    assert b.extra["agent_faults"] == [2]  # metrics.jsonl's agent/faults (trainer/run/step_report.py)
    assert b.extra["agent"] == {"rollouts": [2], "calls": [4], "segments": [2]}  # the trained group's two sessions
    from trainer.run.step_metrics import batch_metrics
    got = batch_metrics(b)
    assert (got["agent/calls_per_rollout"], got["agent/segments_per_rollout"]) == (2.0, 1.0)


def test_faults_of_a_round_with_no_batch_reach_the_next_rounds_first_batch(tok):
    """A round whose every group is dropped (here: no spread) uploads nothing: its faults ride on the next batch,
    so metrics.jsonl's agent/faults counts every rollout that had no reward."""
    from dataclasses import replace
    engine = ScriptedEngine(tok, [spelled(tok, "6") + [tok.eos_token_id]])
    cfg = GRPOConfig(model="tiny", num_pre_Q=2, max_new_tokens=50, agent="my_agent.py:solve", reward_fns=[],
                     max_prompt_length=60).validate()
    scorer = RewardScorer.from_config(cfg)
    agents = AgentRollouts(cfg, engine, tok, solve)
    ex = lambda p, i: Example(prompt=p, ground_truth="6", columns={"answer": "6"}, index=i)  # noqa: E731
    try:
        first, _ = generate_batches(engine, tok, [ex("raise", 0), ex("2 * 3?", 1)], cfg, scorer, agents=agents)
        second, _ = generate_batches(engine, tok, [ex("2 * 3?", 2)], replace(cfg, train_zero_spread=True), scorer,
                                     agents=agents)
    finally:
        agents.close()
        scorer.close()
    assert first == [] and [b.extra["agent_faults"] for b in second] == [[2]]


@pytest.mark.parametrize("kw, msg", [
    ({"tools": ["calculator"]}, "cannot be combined with tools or environment_factory"),
    ({"environment_factory": "envs.py:Env"}, "cannot be combined with tools or environment_factory"),
    ({"zero_stage": 3}, "genonly workers"),
    ({"zero_stage": 3, "num_gen_workers": 1, "get_wait": 2.0}, "genonly workers"),
    ({"agent": "solve"}, "names no function"),
    ({"eval_steps": 5}, "in-training evaluation does not run the agent yet"),
    ({"eval_before": True}, "in-training evaluation does not run the agent yet"),
    ({"agent_timeout": 0}, "agent_timeout must be > 0"),
    ({"agent_max_concurrency": 0}, "agent_max_concurrency must be >= 1"),
])
def test_agent_config_refusals(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GRPOConfig(**{"agent": "my_agent.py:solve", **kw}).validate()


def test_agent_config_defaults_and_what_is_allowed():
    c = GRPOConfig(agent="my_agent.py:solve").validate()
    assert c.agent_timeout == 300 and c.agent_max_concurrency is None and c.reward_specs() == []
    GRPOConfig(agent="my_agent.py:solve", zero_stage=3, num_gen_workers=1, get_wait=0).validate()
    assert GRPOConfig().agent is None and GRPOConfig().reward_specs() == ["correct", "format"]


def test_a_round_where_every_agent_fails_ends_the_producer_in_one_line(tok):
    engine = ScriptedEngine(tok, [spelled(tok, "6") + [tok.eos_token_id]])
    cfg = GRPOConfig(model="tiny", num_pre_Q=2, max_new_tokens=50, agent="my_agent.py:solve").validate()
    scorer = RewardScorer.from_config(cfg)
    agents = AgentRollouts(cfg, engine, tok, solve)
    try:
        with pytest.raises(RuntimeError, match=r"^agent my_agent.py:solve: every rollout of the round failed; the "
                                               r"first: raised ValueError: boom$"):
            generate_batches(engine, tok, [Example(prompt="raise", ground_truth="6", columns={"answer": "6"})], cfg,
                             scorer, agents=agents)
    finally:
        agents.close()
        scorer.close()


def test_a_rank_generating_for_itself_runs_the_agent_from_the_users_folder(tok, tmp_path, monkeypatch):
    """trainer/batches.py: a rank's own rounds get its AgentRollouts (an endpoint over the rank's HF engine, the
    user's function loaded from GRPO_USER_DIR); launch.sh runs this path with --workers 0 (no genonly worker)."""
    import trainer.batches as tb
    from common.user_code import USER_DIR_ENV
    from trainer.rollout import RolloutStats

    (tmp_path / "rank_agent.py").write_text("def solve(base_url, model, prompt, **columns):\n    return None\n")
    monkeypatch.setenv(USER_DIR_ENV, str(tmp_path))
    seen = {}
    monkeypatch.setattr(tb, "generate_batches", lambda *a, **k: (seen.update(k), ([], RolloutStats()))[1])

    class Sampler:
        def next_batch(self, n):
            return []

        def progress(self) -> float:
            return 0.0

    cfg = GRPOConfig(model="tiny", agent="rank_agent.py:solve", num_gen_workers=0, max_new_tokens=8).validate()
    class Client:
        outages = 0

    src = tb.BatchSource(cfg, Client(), None, tok, Sampler(), [], [tok.eos_token_id], len(tok),
                         producer_id="trainer-rank0")
    try:
        src._generate(0, {"gen_s": 0.0}, RolloutStats())
        assert seen["agents"] is src.agents and src.agents.agent.__name__ == "solve"
        assert src.agents.server.endpoint.batcher.engine is src.engine  # the rank's own engine serves it
        models = openai.OpenAI(base_url=src.agents.server.base_url(src.agents.server.endpoint.open_session()),
                               api_key="k", max_retries=0).models.list()
        assert [m.id for m in models.data] == ["tiny"]
    finally:
        src.agents.close()


def test_a_batch_is_as_old_as_its_oldest_recorded_call(tok):
    """Each call records the policy version that sampled it; a batch carries its oldest call's (the staleness bound
    drops it by that). A weight load between two calls of a session (here: the version moved by hand) shows in the
    calls' records, and the batch stays as old as the first call."""
    engine = ScriptedEngine(tok, [spelled(tok, "6") + [tok.eos_token_id]])
    cfg = GRPOConfig(model="tiny", num_pre_Q=2, max_new_tokens=50, agent="my_agent.py:solve", reward_fns=[],
                     train_zero_spread=True, max_prompt_length=60).validate()
    held: dict = {}

    def moved(base_url, model, prompt, answer):
        client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0)
        msgs = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model=model, messages=msgs)
        held["agents"].version = 7  # newer weights between this session's calls
        client.chat.completions.create(model=model, messages=msgs + [r.choices[0].message.model_dump(),
                                                                     {"role": "user", "content": "Sure?"}])
        return 1.0

    scorer = RewardScorer.from_config(cfg)
    agents = held["agents"] = AgentRollouts(cfg, engine, tok, moved)
    try:
        (b,), _ = generate_batches(engine, tok, [Example(prompt="2 * 3?", ground_truth="6",
                                                         columns={"answer": "6"}, index=0)], cfg, scorer,
                                   policy_version=5, agents=agents)
    finally:
        agents.close()
        scorer.close()
    assert b.policy_version == 5 and b.extra["agent"]["calls"] == [4]
