"""Runs that cannot train must say so (issue 11, items 3-4): equal-reward groups, sync_steps=0 staleness."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, start_ref_server, subprocess_env

from common.config import GRPOConfig
from common.modeling import eos_ids, load_model, load_tokenizer
from common.wire.client import RefClient
from common.wire.protocol import ScoredBatch
from ref_server.status import format_table
from trainer.batches import is_stale
from trainer.data.loading import load_examples
from trainer.engines.hf import HFEngine
from trainer.rewards.scoring import RewardScorer
from trainer.rollout import RolloutStats, generate_batches
from trainer.run.stall import NoRewardSpread, StallReporter


def minus_two(completion: str, ground_truth: str) -> float:
    """A weak model on a hard task: every completion is wrong and unformatted."""
    return -2.0


def test_stall_reporter_logs_cumulative_counts_while_nothing_trains(caplog):
    now = [0.0]
    rep = StallReporter("worker0", every=30.0, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 12.0
        rep.add(RolloutStats(groups=2, skipped_no_spread=2, rewards=[-2.0] * 16), produced=0)
    with caplog.at_level("WARNING", logger="trainer"):
        msg = rep.maybe_log()
    assert msg is not None and "6 groups sampled, 6 skipped for no reward spread" in msg
    assert "-2: 48" in msg and "train_zero_spread" in msg
    assert rep.maybe_log() is None  # once per period
    now[0] += 31.0
    assert rep.maybe_log() is not None  # and again while it lasts
    rep.add(RolloutStats(groups=1, rewards=[0.0, 1.0]), produced=1)
    now[0] += 20.0
    assert rep.maybe_log() is None  # progress resets the clock


def test_no_spread_is_bounded_with_each_rewards_values_and_skipped_completions(caplog):
    """Issue 60: the warning gave only the summed reward ({0: 360}); it now gives each reward function's values and
    a few completions of skipped groups, and max_no_spread_groups groups in a row without spread (no batch since)
    end the run: one line, exit 8 (NoRewardSpread, trainer/main.py). A produced batch resets the count."""
    now = [0.0]
    rep = StallReporter("worker0", every=30.0, clock=lambda: now[0], no_spread_groups=6)

    def flat_round():
        return RolloutStats(groups=2, skipped_no_spread=2, rewards=[0.0] * 16,
                            components={"correct": [0.0] * 16, "format": [None] * 16},
                            skipped_samples=[("The answer is 7", {"correct": 0.0, "format": None})])
    rep.add(flat_round(), produced=0)
    assert rep.state() == "nothing to train: 2 groups in a row without reward spread"
    rep.add(RolloutStats(groups=1, rewards=[0.0, 1.0], components={"correct": [0.0, 1.0]}), produced=1)
    assert rep.state() is None  # a batch came: the count starts again
    rep.add(flat_round(), produced=0)
    rep.add(flat_round(), produced=0)
    now[0] += 31.0
    with caplog.at_level("WARNING", logger="trainer"):
        msg = rep.maybe_log()
    assert "per reward: correct {0: 49, 1: 1}; format {None: 48}" in msg, msg
    assert "skipped: 'The answer is 7' -> correct 0.0, format None" in msg
    with pytest.raises(NoRewardSpread) as e:
        rep.add(flat_round(), produced=0)
    line = str(e.value)
    assert e.value.exit_code == 8 and "\n" not in line
    assert line.startswith("worker0: the last 6 groups sampled all had equal rewards") and "train_zero_spread" in line
    assert "correct {0: 65, 1: 1}" in line and "max_no_spread_groups 6" in line
    # train_zero_spread trains every group: no bound (and TRL's behaviour, configs/trl_defaults.json)
    assert StallReporter.from_config("w", GRPOConfig(train_zero_spread=True)).no_spread_groups == 0
    assert StallReporter.from_config("w", GRPOConfig()).no_spread_groups == GRPOConfig().max_no_spread_groups > 0


def test_zero_spread_groups_train_when_asked(tiny_model_dir):
    tok, model = load_tokenizer(str(tiny_model_dir)), load_model(str(tiny_model_dir))
    examples = load_examples("arith", limit=2)
    base = dict(num_pre_Q=4, max_new_tokens=4, temperature=1.0, top_p=1.0, system_prompt="", max_prompt_length=256,
                gen_batch_size=8, advantage_mode="grpo", compute_gen_logps=True, logp_chunk_tokens=64)
    engine = HFEngine(model, tok, eos_ids(tok, model), temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=8)
    scorer = RewardScorer(["test_stall:minus_two"], timeout=0)
    skipped, st = generate_batches(engine, tok, examples, GRPOConfig(**base, train_zero_spread=False), scorer)
    assert skipped == [] and st.skipped_no_spread == 2
    assert [r for _, r in st.skipped_samples] == [{"minus_two": -2.0}] * 2  # for the warning: what was written
    kept, st = generate_batches(engine, tok, examples, GRPOConfig(**base, train_zero_spread=True), scorer)
    assert len(kept) == 2 and st.skipped_no_spread == 0
    for b in kept:  # zero advantages: the policy-gradient term vanishes, the KL term alone trains
        assert torch.equal(b.advantages, torch.zeros(4)) and (b.rewards == -2).all()


def _scored(version: int, producer: str) -> ScoredBatch:
    return SimpleNamespace(policy_version=version, producer_id=producer)  # what is_stale reads


def test_sync_off_does_not_drop_worker_batches():
    off = GRPOConfig(sync_steps=0, num_gen_workers=1, max_staleness=2)
    on = GRPOConfig(sync_steps=1, num_gen_workers=1, max_staleness=2)
    # with sync off a worker keeps its initial weights: its batches say version 0 at every step
    assert not is_stale(off, 50, _scored(0, "worker0"))
    assert is_stale(on, 50, _scored(0, "worker0"))
    assert not is_stale(on, 2, _scored(0, "worker0"))
    assert is_stale(off, 50, _scored(10, "trainer-rank1"))  # a rank's own batches carry real versions


@pytest.mark.slow
def test_worker_logs_the_stall_and_trains_zero_spread_when_asked(tiny_model_dir, tmp_path):
    """A real genonly worker on an all -2 task: it says why nothing arrives; train_zero_spread uploads."""
    args = ["--model", str(tiny_model_dir), "--data", "arith", "--reward_fns", "test_stall:minus_two",
            "--system_prompt", "", "--max_new_tokens", "4", "--num_pre_Q", "4", "--Q_batch_size", "2",
            "--log_stall_every", "0.01", "--worker_rounds", "4", "--sync_steps", "0", "--heartbeat_s", "0.2"]
    env = subprocess_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    logs = {}
    with start_ref_server(tiny_model_dir) as srv:
        for zero_spread, want_uploads in (("false", 0), ("true", 8)):
            proc = subprocess.run([sys.executable, "trainer/main.py", "genonly", *args, "--ref_server", srv.url,
                                   "--train_zero_spread", zero_spread, "--max_no_spread_groups", "6"], cwd=REPO,
                                  env=env, capture_output=True, text=True, timeout=300)
            logs[zero_spread] = proc.stderr
            if zero_spread == "false":  # issue 60: bounded, one line, exit 8 (the 3rd round's 6th flat group)
                assert proc.returncode == 8, proc.stderr[-2000:]
                last = proc.stderr.strip().splitlines()[-1]
                assert last.startswith("worker0: the last 6 groups sampled all had equal rewards"), last
                assert "minus_two {-2: 24}" in last
                # its heartbeat said so meanwhile: `launch.sh status` shows it as not training (not as stalled)
                table = format_table(RefClient(srv.url).status())
                assert "not training: worker0" in table and "stalled: none" in table, table
                continue
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert f"{want_uploads} batches uploaded" in proc.stderr, proc.stderr[-2000:]
        assert RefClient(srv.url).stats()["uploads_accepted"] == 8
    assert "nothing to train on" in logs["false"] and "skipped for no reward spread" in logs["false"]
    assert "per reward: minus_two {-2: " in logs["false"] and "    skipped: '" in logs["false"]
    assert "rewards seen {-2: " in logs["false"] and "train_zero_spread" in logs["false"]
    assert "nothing to train on" not in logs["true"]
