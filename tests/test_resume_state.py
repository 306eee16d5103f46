"""Exact resume, in process: PromptSampler and RNG state round trips (the end-to-end test is in test_hang.py)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from trainer import resume
from trainer.data.loading import Example, PromptSampler

EXAMPLES = [Example(prompt=f"q{i}", ground_truth=str(i)) for i in range(23)]


@pytest.mark.parametrize("cut", [0, 1, 5, 11, 12, 30, 47])
def test_sampler_continues_exactly(cut):
    full = PromptSampler(EXAMPLES, seed=3, shard=1, num_shards=2)
    reference = [ex.index for ex in full.next_batch(60)]
    first = PromptSampler(EXAMPLES, seed=3, shard=1, num_shards=2)
    head = [ex.index for ex in first.next_batch(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON
    second = PromptSampler(EXAMPLES, seed=3, shard=1, num_shards=2)
    second.load_state_dict(state)
    assert head + [ex.index for ex in second.next_batch(60 - cut)] == reference


def test_sampler_examples_carry_their_index_and_are_not_mutated():
    s = PromptSampler(EXAMPLES, seed=0)
    ex = next(s)
    assert EXAMPLES[ex.index].prompt == ex.prompt and all(e.index is None for e in EXAMPLES)


@pytest.mark.parametrize("change", [dict(seed=4), dict(shard=0), dict(num_shards=3, shard=1)])
def test_sampler_state_refuses_another_setup(change):
    state = PromptSampler(EXAMPLES, seed=3, shard=1, num_shards=2).state_dict()
    kw = dict(seed=3, shard=1, num_shards=2) | change
    with pytest.raises(ValueError, match="does not fit"):
        PromptSampler(EXAMPLES, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(EXAMPLES[:-1], seed=3, shard=1, num_shards=2).load_state_dict(state)


def test_rng_state_round_trip(tmp_path):
    s = PromptSampler(EXAMPLES, seed=1)
    s.next_batch(7)
    torch.manual_seed(11)
    random.seed(5)
    state = json.loads(json.dumps(resume.capture(s)))
    expect = (torch.rand(5), random.random(), [e.index for e in s.next_batch(4)])
    torch.manual_seed(999)
    random.seed(999)
    s2 = PromptSampler(EXAMPLES, seed=1)
    resume.restore(s2, state)
    assert torch.equal(torch.rand(5), expect[0]) and random.random() == expect[1]
    assert [e.index for e in s2.next_batch(4)] == expect[2]


def test_rank_states_next_to_the_checkpoint(tmp_path):
    ds = tmp_path / "ds"
    states = [{"sampler": {"pos": r}} for r in range(2)]
    resume.save_rank_states(ds, "step4", states)
    assert resume.load_rank_state(ds, 1, 2) is None  # no `latest` yet: DeepSpeed writes it after us
    (ds / "latest").write_text("step4")
    assert resume.load_rank_state(ds, 1, 2) == {"sampler": {"pos": 1}}
    with pytest.raises(ValueError, match="same number of ranks"):
        resume.load_rank_state(ds, 0, 4)


def test_batches_from_before_a_resume_are_used_only_within_max_staleness():
    from trainer.batches import usable_version
    # resumed at version 4 (the crash lost steps 5..7 whose batches the server still holds)
    assert [v for v in range(0, 9) if usable_version(v, 4, max_staleness=2)] == [2, 3, 4]
    assert usable_version(4, 4, 0) and not usable_version(3, 4, 0)
