"""The ref server's Scorer in process (no HTTP, no thread): merging batches within score_token_budget, row slices,
error isolation, packed or length-grouped forwards, each checked against a float64 plain forward."""
from __future__ import annotations

import pytest
import torch
from test_ref_server import direct_ref_logps, make_batch

from common.modeling import load_model
from common.wire.protocol import decode_scored


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


# ---------------------------------------------------------------------------------------
def test_scorer_merges_within_budget_and_survives_a_bad_batch(ref_model):
    """In-process (no thread): grouping by score_token_budget, row slicing, split-back, error isolation."""
    from ref_server.scorer import Scorer, ServerMetrics

    metrics = ServerMetrics()
    sc = Scorer(ref_model, metrics, max_queue=10, max_output_queue=10, score_token_budget=120, chunk_tokens=8)
    a, b = make_batch([4, 6], [8, 5], L=16, seed=1), make_batch([3, 9, 2], [7, 11, 1], L=20, seed=2)
    c, d = make_batch([5], [6], L=12, seed=3), make_batch([2, 2], [2, 9], L=16, seed=4)
    big = make_batch([3] * 10, list(range(1, 11)), L=16, seed=5)  # 160 tokens > budget: scored in row slices
    for x in (a, b, c, d, big):
        sc.submit(x)
    with torch.inference_mode():
        groups = []
        while sc.inq:
            g = sc._next_group()
            groups.append([x.batch_id for x in g])
            for s in sc._score_group(g):
                sc.outq.append(s)
        assert groups == [[a.batch_id, b.batch_id, c.batch_id], [d.batch_id], [big.batch_id]]  # 6x20 <= 120 < 8x20
        for x in (a, b, c, d, big):
            s = decode_scored(sc.take())
            assert s.batch_id == x.batch_id
            assert (s.ref_logps.double() - direct_ref_logps(ref_model, x)).abs().max().item() <= 1e-5
        # A batch the model cannot take (token id out of range) fails the merged forward; the others survive.
        bad = make_batch([3], [3], seed=6)
        bad.input_ids[0, 1] = 10**6
        good = make_batch([3], [3], seed=7)
        out = sc._score_group([bad, good])
    assert [o.batch_id for o in out] == [good.batch_id] and metrics.errors == 1
    assert metrics.scored == 6 and metrics.forwards == 4


@pytest.mark.parametrize("padding_free", [True, False])
def test_scorer_packed_or_grouped_by_length(ref_model, padding_free):
    """The ref server's scoring padding-free (one packed sequence per forward) or padded with rows grouped by
    length: the same ref logprobs; the padding share it reports is 0 packed, and below the share of padding every
    row to the longest when padded."""
    from ref_server.scorer import Scorer, ServerMetrics

    metrics = ServerMetrics()
    sc = Scorer(ref_model, metrics, max_queue=10, max_output_queue=10, score_token_budget=64, chunk_tokens=8,
                padding_free=padding_free)
    b = make_batch([3, 3, 3, 3, 3, 3], [2, 30, 3, 28, 4, 1], L=40, seed=21)
    with torch.inference_mode():
        out = sc._score([b])
    s = decode_scored(out[0].body)
    assert (s.ref_logps.double() - direct_ref_logps(ref_model, b)).abs().max().item() <= 1e-5
    real = int((b.prompt_lens + b.completion_lens).sum())
    assert metrics.forwards == 1 and metrics.tokens_forward == real
    snap = metrics.snapshot()
    assert snap["padding_free"] is padding_free and "grpo_ref_padding_share" in generate_metrics(metrics)
    if padding_free:
        assert metrics.tokens_computed == real and snap["padding_share"] == 0.0
    else:
        every_row_to_longest = 1 - real / (6 * 33)
        assert 0 < snap["padding_share"] < every_row_to_longest / 2


def generate_metrics(metrics) -> str:
    from prometheus_client import generate_latest
    return generate_latest(metrics.registry).decode()
