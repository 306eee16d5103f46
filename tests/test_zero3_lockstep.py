"""ZeRO-3 ranks stay in lockstep (issue 22 item 2): under stage 3 every module call gathers the partitioned
weights from all ranks, so every rank must make the same calls.

Before the fix, 2 CPU ranks whose longest completions differed made different numbers of LM-head calls in
the logprob chunk loop (rank 0: 32 chunks, rank 1: 12) and rank 1 aborted with gloo's "Received data size
doesn't match expected size. Is there a distributed collective mismatch"; rank 0 then failed with
"Connection reset by peer" (tests/zero3_probe.py on the old code).
"""
from __future__ import annotations

import json

import pytest
from conftest import REPO, find_free_port, run_process_group, start_ref_server
from test_e2e import env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe(rank_probes) -> tuple[int, str]:
    """Real DeepSpeed ZeRO-3 engines on 2 ranks (tests/zero3_probe.py in the suite's one launch of 2-rank probes,
    tests/rank_probes.py) for both probe tests below: scenario 0 as the trainer chooses its forwards, scenario 1
    packed (a fresh engine in the same ranks)."""
    return rank_probes.returncode, rank_probes.out


def test_ranks_with_different_completion_lengths_train_in_micro_batches(probe):
    """Real DeepSpeed ZeRO-3 engines on 2 ranks; rank 0's longest completion is 64 tokens, rank 1's 24."""
    rc, out = probe
    assert "rank0 scenario 0 DONE" in out and "rank1 scenario 0 DONE" in out, out[-4000:]
    assert "rank0 scenario 0 step 2 loss" in out and "rank1 scenario 0 step 2 loss" in out


def test_pipeline_generates_trains_and_evaluates_in_lockstep(tiny_model_dir, tmp_path):
    """ref server + `deepspeed --num_gpus 2` at stage 3: ranks generate their own rollouts (64 new tokens,
    lengths differ between ranks), logprobs in 8-position chunks, micro-batches of 2, eval of an odd number
    of examples at step 2 one prompt per generate call (shards of 2 and 1: rank 1 makes a dummy call), packed
    forwards of at most 110 tokens (generation-time logprobs and training; without the ranks agreeing on the pack
    count this run hung, seed 1).
    Before the fix the run hung in that eval (rank 0 alone, rank 1 in the barrier) until dist_timeout."""
    with start_ref_server(tiny_model_dir) as srv:
        cmd = [str(REPO / ".venv" / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(find_free_port()),
               "trainer/main.py", "--model", "tiny", "--data", "arith", "--system_prompt", "",
               "--reward_fns", "toy_rewards:digit_fraction", "--num_pre_Q", "4", "--temperature", "1.0",
               "--seed", "1", "--ref_server", srv.url, "--output_dir", str(tmp_path), "--zero_stage", "3",
               "--max_new_tokens", "64", "--logp_chunk_tokens", "8", "--micro_batch_size", "2",
               "--Q_batch_size", "1", "--num_gen_workers", "0", "--all_steps", "2", "--save_steps", "1000",
               "--eval_steps", "2", "--eval_limit", "3", "--eval_max_new_tokens", "16", "--gen_batch_size", "1",
               "--dist_timeout", "120", "--lr", "1e-3",
               "--pack_tokens", "110"]  # 78-token rows (64 new) alone, shorter ones paired: pack counts differ
        proc = run_process_group(cmd, cwd=REPO, env=env(), timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["eval_n"] == 3  # both ranks' shards counted
    # padding_free auto: chosen per batch from both ranks' summed work estimates (common/pack_choice.py), so the
    # ranks stayed in lockstep whatever it chose; said per step (the share of the step's batches packed), and a
    # step whose batches all packed computed no padded token
    assert all(0.0 <= r["padding_free"] <= 1.0 for r in rows)
    assert all(r["padding_share"] == 0.0 for r in rows if r["padding_free"] == 1.0)


def test_ranks_needing_different_pack_counts_stay_in_lockstep(probe):
    """padding_free true with packs of at most 64 tokens (common/packing.py pack_plan): rank 0's first
    micro-batch (rows of 70, 67, 64 tokens) is 3 packs, rank 1's (30, 27, 24) 2, with other head-call counts per
    pack; rank 1 makes a dummy pack's forward (and its backward) so both ranks make the same module calls."""
    from zero3_probe import batch_for

    from common.packing import pack_plan
    firsts = [batch_for(rank, 4, 100) for rank in (0, 1)]
    assert [len(pack_plan(b.prompt_lens[:3], b.completion_lens[:3], 64)) for b in firsts] == [3, 2]
    rc, out = probe  # scenario 1: micro_batch_size 3, pack_tokens 64, padding_free true
    assert rc == 0, out[-4000:]
    assert "rank0 scenario 1 DONE" in out and "rank1 scenario 1 DONE" in out
    assert "rank0 PROBE DONE" in out and "rank1 PROBE DONE" in out
