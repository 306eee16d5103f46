"""`launch.sh train` with one vLLM genonly worker on the tiny model (real ref server, real deepspeed ranks,
real vLLM engine on CPU): runs to all_steps, trains only batches within max_staleness, logs the
train/inference logprob mismatch (with the truncated-IS correction on), and the worker follows the policy
in place, by deltas (sync_delta, issue 25) with the same mismatch as full copies."""
from __future__ import annotations

import re

import pytest
from conftest import REPO, find_free_port, run_process_group
from test_e2e import TOY, env, leftover_processes, read_rows

pytestmark = pytest.mark.slow


def test_launch_train_with_a_vllm_worker(tmp_path):
    run_dir, port = tmp_path / "run", find_free_port()
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--skip-checks", "--run-dir", str(run_dir), "--workers", "1",
           "--gpus", "2",
           "--port", str(port), "--", *TOY, "--Q_batch_size", "2", "--get_wait", "0", "--all_steps", "5",
           "--save_steps", "1000", "--sync_steps", "1", "--max_staleness", "2", "--lr", "1e-3",
           "--gen_backend", "vllm", "--vllm_dtype", "float32", "--vllm_importance_sampling_mode", "token_truncate",
           "--vllm_importance_sampling_clip_max", "2.0",
           "--sync_delta_max_share", "1.0"]  # lr 1e-3 moves over 15 % of the elements: deltas all the same
    # REPO first on the path: this checkout's code wins over an editable install of another one
    proc = run_process_group(cmd, cwd=REPO, env={**env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=600)
    worker_log = (run_dir / "worker0.log").read_text() if (run_dir / "worker0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + worker_log[-3000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 2 for r in rows), [r["staleness_max"] for r in rows]
    assert all("logp_mismatch_mean" in r and "logp_mismatch_max" in r for r in rows)
    assert all(0 < r["is_weight_mean"] <= 2.0 for r in rows)  # truncated IS on: weights capped at clip_max
    # get_wait 0: every batch came from the vLLM worker; float32 engine, so the mismatch is policy drift only
    assert all(0 <= r["logp_mismatch_mean"] < 1.0 for r in rows), [r["logp_mismatch_mean"] for r in rows]
    fresh = [r["logp_mismatch_max"] for r in rows if r["staleness_max"] == 0]
    assert all(m < 1e-4 for m in fresh), fresh  # same weights: engine and trainer agree
    assert "generation engine: vllm" in worker_log and "policy weights v" in worker_log
    # delta sync (default): every step's publish is a delta (the start's was the full copy), the worker
    # applies deltas through vLLM's in-place reload, and the fresh-batch mismatch above is the full-sync one.
    # It follows each version while paused (worker_max_queued): before that it could wait out two publishes at
    # every pause and fetch only full copies (v0, v2, v4 in a CI-like run, and this line failed)
    assert all(r["sync_mb_up_delta"] > 0 and r["sync_mb_up_full"] == 0 for r in rows), rows
    assert all(r["sync_mb"] >= r["sync_mb_up_delta"] for r in rows)
    assert "(delta, " in worker_log and "refetching the full copy" not in worker_log
    # a delta the worker fetched while training went on is in the rows' sync_mb_down_delta; the last version's,
    # published after the last row, cannot be (a suite run: v0, v2, v4 full as it fell behind, v5 by delta after
    # step 5's row, and nothing to count)
    fetched = re.findall(r"policy weights v(\d+) applied in \S+ s \(delta", worker_log)
    if any(int(v) < len(rows) - 1 for v in fetched):
        assert sum(r["sync_mb_down_delta"] for r in rows) > 0, (fetched, rows)
    assert "Traceback" not in worker_log
    assert leftover_processes(f"127.0.0.1:{port}") == []
    print("mismatch mean/max per step:", [(round(r["logp_mismatch_mean"], 6), round(r["logp_mismatch_max"], 6),
                                          r["staleness_max"]) for r in rows])


def test_gspo_with_a_bf16_vllm_worker_learns_with_trainer_pi_old(tmp_path):
    """Issue 24's proof run: GSPO (sequence clip 3e-4 / 4e-4) fed only by a bf16 vLLM worker up to 2 versions
    behind. π_old is the trainer's first pass, so every completion starts inside the clip band; the share the
    engine's logprobs would have left inside it (the former π_old) is measured on the same batches; the IS
    correction (TRL's default sequence_mask, cap 3) logs its mean weight and masked share, next to the KL."""
    run_dir, port = tmp_path / "run", find_free_port()
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--skip-checks", "--run-dir", str(run_dir), "--workers", "1",
           "--gpus", "2",
           "--port", str(port), "--", *TOY, "--Q_batch_size", "2", "--get_wait", "0", "--all_steps", "20",
           "--save_steps", "1000", "--sync_steps", "1", "--max_staleness", "2", "--lr", "6e-3",
           "--gen_backend", "vllm", "--vllm_dtype", "bfloat16", "--importance_sampling_level", "sequence"]
    proc = run_process_group(cmd, cwd=REPO, env={**env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=900)
    worker_log = (run_dir / "worker0.log").read_text() if (run_dir / "worker0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + worker_log[-3000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    print("step, staleness, IS weight mean, IS masked share, KL, in band (engine π_old), in band (trainer π_old):")
    for r in rows:
        print(r["step"], r["staleness"], round(r["is_weight_mean"], 4), round(r["is_masked_share"], 4),
              round(r["kl"], 5), round(r["gspo_in_band_engine"], 3), r["gspo_in_band"])
    assert all(r["gspo_in_band"] == 1.0 and r["clip_frac"] == 0.0 for r in rows)  # mu 1: ratio 1 everywhere
    assert all(0 < r["is_weight_mean"] <= 3.0 and 0 <= r["is_masked_share"] <= 1 for r in rows)
    before = sum(r["gspo_in_band_engine"] for r in rows) / len(rows)
    print(f"share of completions inside the GSPO band on the first pass: engine π_old {before:.3f}, trainer π_old 1.0")
    assert before < 1.0  # bf16 engine + staleness: the former π_old left completions outside the band
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"toy reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    # measured +0.36 to +0.62 in 7 runs, then +0.216 (0.009 -> 0.225) in a README run at f5659cc (the ranks and the
    # worker race for the server's batches): +0.15 is still ~15x the untrained reward
    assert last >= first + 0.15, rewards
    assert leftover_processes(f"127.0.0.1:{port}") == []
