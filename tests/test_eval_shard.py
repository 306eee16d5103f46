"""In-training eval is sharded over the ranks at every ZeRO stage (issue 30, section 3): at stages 0-2 rank 0
used to evaluate the whole set while the other ranks waited in a barrier under dist_timeout (600 s by default,
less than a 7B model's GSM8K eval). Now each rank evaluates its own share and the counts are summed.

Real DeepSpeed ranks (gloo, 2 CPU processes, tests/eval_shard_probe.py in tests/rank_probes.py's launch). On the
old code run_eval at stage 2 evaluated all 7 examples on each rank (rank 0: [0..6]), so the shares were not
disjoint.
"""
from __future__ import annotations

import json

import pytest
from rank_probes import EVAL_STAGES as STAGES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe(rank_probes) -> tuple[str, list[dict]]:
    """Both stages in the one 2-rank launch of the suite's probes (a fresh engine each in the same ranks)."""
    out = rank_probes.out
    assert rank_probes.returncode == 0, out[-4000:]
    # the launcher may put the two ranks' lines together: read each JSON object after its marker
    return out, [json.JSONDecoder().raw_decode(part)[0] for part in rank_probes.stdout.split("EVALPROBE ")[1:]]


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_evaluates_its_share_and_the_sum_is_the_whole_set(probe, stage):
    out, lines = probe
    ranks = sorted((r for r in lines if r["zero_stage"] == stage), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], out[-4000:]
    # disjoint shares covering every example once, the same split on every run (rank r: r, r + 2, ...)
    assert ranks[0]["evaluated"] == [0, 2, 4, 6], ranks[0]["evaluated"]
    assert ranks[1]["evaluated"] == [1, 3, 5], ranks[1]["evaluated"]
    ref = ranks[0]["reference"]  # one process, whole set
    assert ref["n"] == 7 and 0 < ref["correct"] < 7, ref  # an accuracy that a wrong sum would change
    assert ranks[1]["reference"] == ref  # both ranks hold the same weights (ZeRO < 3)
    for r in ranks:  # every rank logs the same summed result, equal to the single-process eval's
        assert r["result"] == {"eval_accuracy": ref["accuracy"], "eval_format": ref["format_rate"], "eval_n": 7}
