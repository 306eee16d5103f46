"""Tests that need CUDA: the GPU check (bench/gpu_check.py) on the real GPU, and the placement plan from the real
nvidia-smi. Marked `gpu` (pytest -m gpu runs only these); skipped, with the reason, where CUDA is absent (CI).
The full check (bench/gpu_check.py: ZeRO-2 + vLLM, ZeRO-3 micro-batches packed, LoRA on Qwen2.5-0.5B's shape, the
update probe, the HF reference loop) runs here as on a lent GPU."""
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


def test_gpu_check_runs_every_variant_within_its_deadline(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    env.pop("DS_ACCELERATOR", None)  # the CUDA accelerator, NCCL
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--work", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] and res["within_deadline"], proc.stderr[-3000:]
    assert res["zero3_vs_zero2_rel_diff"] <= 1e-3 and res["hf_tokens_per_s"] > 0
    for name in ("zero2_vllm", "zero3_micro_packed", "lora"):
        r = json.loads((tmp_path / f"variant-{name}.json").read_text())
        assert r["ok"] and r["rank0_max_memory_allocated_mib"] > 0 and r["gen_tokens_per_s"], r
        assert r["rank0_max_memory_reserved_mib"] >= r["rank0_max_memory_allocated_mib"], r


def test_placement_sees_the_gpus_torch_sees():
    from common.placement.launch_plan import detect_gpus
    gpus, how, _ = detect_gpus()
    assert len(gpus) == torch.cuda.device_count(), how
