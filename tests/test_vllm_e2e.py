"""`launch.sh train` with one vLLM genonly worker on the tiny model (real ref server, real deepspeed ranks,
real vLLM engine on CPU): runs to all_steps, trains only batches within max_staleness, logs the
train/inference logprob mismatch (with the truncated-IS correction on), and the worker follows the policy
in place, by deltas (sync_delta, issue 25) with the same mismatch as full copies."""
from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, find_free_port
from test_e2e import TOY, env, leftover_processes, read_rows

pytestmark = pytest.mark.slow


def test_launch_train_with_a_vllm_worker(tmp_path):
    run_dir, port = tmp_path / "run", find_free_port()
    cmd = ["bash", str(REPO / "launch.sh"), "train", "--run-dir", str(run_dir), "--workers", "1", "--gpus", "2",
           "--port", str(port), "--", *TOY, "--Q_batch_size", "2", "--get_wait", "0", "--all_steps", "5",
           "--save_steps", "1000", "--sync_steps", "1", "--max_staleness", "2", "--lr", "1e-3",
           "--gen_backend", "vllm", "--vllm_dtype", "float32", "--tis_cap", "2.0",
           "--sync_delta_max_share", "1.0"]  # lr 1e-3 moves over 15 % of the elements: deltas all the same
    # REPO first on the path: this checkout's code wins over an editable install of another one
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
                          capture_output=True, text=True, timeout=600)
    worker_log = (run_dir / "worker0.log").read_text() if (run_dir / "worker0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + worker_log[-3000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 2 for r in rows), [r["staleness_max"] for r in rows]
    assert all("logp_mismatch_mean" in r and "logp_mismatch_max" in r for r in rows)
    assert all(0 < r["tis_weight_mean"] <= 2.0 for r in rows)  # truncated IS on: weights capped at tis_cap
    # get_wait 0: every batch came from the vLLM worker; float32 engine, so the mismatch is policy drift only
    assert all(0 <= r["logp_mismatch_mean"] < 1.0 for r in rows), [r["logp_mismatch_mean"] for r in rows]
    fresh = [r["logp_mismatch_max"] for r in rows if r["staleness_max"] == 0]
    assert all(m < 1e-4 for m in fresh), fresh  # same weights: engine and trainer agree
    assert "generation engine: vllm" in worker_log and "policy weights v" in worker_log
    # delta sync (default): every step's publish is a delta (the start's was the full copy), the worker
    # applies deltas through vLLM's in-place reload, and the fresh-batch mismatch above is the full-sync one
    assert all(r["sync_mb_up_delta"] > 0 and r["sync_mb_up_full"] == 0 for r in rows), rows
    assert all(r["sync_mb"] >= r["sync_mb_up_delta"] for r in rows)
    assert sum(r["sync_mb_down_delta"] for r in rows) > 0
    assert "(delta, " in worker_log and "refetching the full copy" not in worker_log
    assert "Traceback" not in worker_log
    assert leftover_processes(f"127.0.0.1:{port}") == []
    print("mismatch mean/max per step:", [(round(r["logp_mismatch_mean"], 6), round(r["logp_mismatch_max"], 6),
                                          r["staleness_max"]) for r in rows])
