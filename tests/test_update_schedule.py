"""One step = one optimizer update (issue 24): grad_accum 2 x mu 2 on a real DeepSpeed engine (one gloo rank,
the tiny model) against a hand-computed schedule of updates, fetches, LRs and π_old."""
from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO, find_free_port, subprocess_env

from common.config import GRPOConfig
from trainer.deepspeed_policy import lr_lambda
from trainer.objective.update import starts_round


def test_rounds_start_every_mu_steps_from_the_first_or_resumed_step():
    assert [s for s in range(1, 9) if starts_round(s, 0, 2)] == [1, 3, 5, 7]
    assert [s for s in range(1, 9) if starts_round(s, 0, 1)] == list(range(1, 9))
    assert [s for s in range(4, 9) if starts_round(s, 3, 2)] == [4, 6, 8]  # resumed after step 3: a new round


def test_cosine_horizon_is_all_steps_updates():
    f = lr_lambda(GRPOConfig(all_steps=4, mu=2, lr_schedule="cosine", warmup_steps=1))
    want = [1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 3)), 0.5 * (1 + math.cos(2 * math.pi / 3))]
    assert [f(k) for k in range(4)] == want  # old code: horizon all_steps * mu = 8 -> 1, 1, 0.95, 0.81


def test_grad_accum_2_mu_2_schedule(tiny_model_dir, tmp_path):
    env = subprocess_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    cmd = [sys.executable, str(REPO / "tests" / "update_probe.py"), str(tiny_model_dir), str(tmp_path),
           "--grad_accum", "2", "--mu", "2", "--all_steps", "4", "--lr", "5e-2", "--lr_schedule", "cosine",
           "--warmup_steps", "1", "--beta", "0", "--importance_sampling_level", "token",
           "--vllm_importance_sampling_mode", "token_truncate"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    # hand-computed: step 1 fetches B1, B2; step 2 trains them again; step 3 fetches B3, B4; step 4 again
    assert [r["fetched"] for r in rows] == [True, False, True, False]
    assert [r["batches"] for r in rows] == [["b2", "b3"], ["b2", "b3"], ["b4", "b5"], ["b4", "b5"]]
    assert [r["global_steps"] for r in rows] == [1, 2, 3, 4]  # one optimizer update per step
    assert all(r["moved"] for r in rows)
    f = lr_lambda(GRPOConfig(all_steps=4, lr_schedule="cosine", warmup_steps=1))
    for r, k in zip(rows, range(4)):
        assert abs(r["lr"] - 5e-2 * f(k)) < 1e-12, (r["step"], r["lr"], 5e-2 * f(k))
    # π_old = the first pass: ratio exactly 1 and nothing clipped on a round's first step, not on its second
    for r in rows[0::2]:
        assert r["ratio_mean"] == 1.0 and r["clip_frac"] == 0.0, r
    for r in rows[1::2]:
        assert r["ratio_mean"] != 1.0, r
    # IS weights from the engine's logprobs (far from the trainer's here), fixed at the first pass
    assert all(0 < r["is_weight_mean"] <= 3.0 for r in rows)
    assert rows[0]["is_weight_mean"] == rows[1]["is_weight_mean"]
    print("schedule:", [(r["step"], r["fetched"], r["global_steps"], round(r["lr"], 5), round(r["ratio_mean"], 4),
                         round(r["is_weight_mean"], 3), round(r["is_masked_share"], 3)) for r in rows])


def test_no_engine_logprobs_still_clips_against_the_first_pass():
    """compute_gen_logps false / a batch without engine logprobs (issue 24 item 4): π_old is the first pass, so
    later mu passes are clipped, never silently unclipped; old_logps engine refuses such a batch by name."""
    import pytest
    import torch

    from trainer.objective.grpo import grpo_loss
    from trainer.objective.update import first_pass

    logps = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for cfg in (GRPOConfig(compute_gen_logps=False), GRPOConfig()):
        old, w, stats = first_pass(logps, None, mask, cfg, "b")
        assert torch.equal(old, logps) and w is None
        assert stats == ({} if not cfg.compute_gen_logps else {"is_uncorrected_batches": 1.0})
        moved = (logps + 0.5).requires_grad_(True)  # a later pass: ratio e^0.5 > 1.2, positive advantage
        grpo_loss(moved, None, old, torch.tensor([1.0]), mask, beta=0, eps_low=0.2, eps_high=0.2,
                  aggregation="token_mean", max_new_tokens=2).backward()
        assert torch.equal(moved.grad, torch.zeros(1, 2))  # clipped: no gradient past 1 + eps
    with pytest.raises(ValueError, match="old_logps=engine.*batch b has none"):
        first_pass(logps, None, mask, GRPOConfig(old_logps="engine"), "b")


def test_linear_schedule_decays_to_zero_at_all_steps_like_transformers():
    """TRL's default lr_scheduler_type (issue 31): transformers' get_linear_schedule_with_warmup after our warmup."""
    f = lr_lambda(GRPOConfig(all_steps=5, lr_schedule="linear", warmup_steps=1))
    assert [f(k) for k in range(6)] == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    g = lr_lambda(GRPOConfig(all_steps=4, lr_schedule="linear"))
    assert [g(k) for k in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    import torch
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=4)
    assert [ref.lr_lambdas[0](k) for k in range(5)] == [g(k) for k in range(5)]
