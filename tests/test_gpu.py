"""Tests that need CUDA: the GPU check's reduced form on the real GPU, and the placement plan from the real
nvidia-smi. Marked `gpu` (pytest -m gpu runs only these); skipped, with the reason, where CUDA is absent (CI).
The full check (ZeRO-2 bf16, ZeRO-3, LoRA x tiny, Qwen2.5-0.5B-shaped, 10 steps each) is bench/gpu_check.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (a GPU and a CUDA build of torch); CI has none")]


def test_gpu_check_tiny_runs_every_variant(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    env.pop("DS_ACCELERATOR", None)  # the CUDA accelerator, NCCL
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--models", "tiny", "--steps", "3",
                           "--work", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"], proc.stderr[-3000:]
    for r in res["runs"]:
        assert r["peak_gpu_mib"] > 0 and r["gen_tokens_per_s"] and r["s_per_step"] > 0, r


def test_placement_sees_the_gpus_torch_sees():
    from common.placement.cli import detect_gpus
    gpus, how, _ = detect_gpus()
    assert len(gpus) == torch.cuda.device_count(), how
