"""What a LoRA worker sends its engine (fused layers complete), and W0 read from a hub id through the HF cache."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from trainer.lora.sync import layer_companions

QWEN_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LAYER = [f"self_attn.{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias")] + \
    ["self_attn.o_proj.weight"] + [f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
CKPT = [f"model.layers.{i}.{t}" for i in (0, 1) for t in LAYER] + ["model.embed_tokens.weight", "lm_head.weight"]


def test_companions_complete_each_fused_layer_and_nothing_else():
    merged = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
              "model.layers.1.mlp.up_proj.weight"]
    assert layer_companions(merged, QWEN_FUSED, CKPT) == [
        "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias",
        "model.layers.1.mlp.gate_proj.weight"]


def test_unfused_engine_gets_the_modules_own_bias_only():
    assert layer_companions(["model.layers.0.self_attn.q_proj.weight"], {}, CKPT) == \
        ["model.layers.0.self_attn.q_proj.bias"]
    assert layer_companions(["model.layers.0.self_attn.o_proj.weight"], QWEN_FUSED, CKPT) == []


def hub_cache(home, repo_id: str, src) -> str:
    """The Hugging Face cache layout from_pretrained leaves: refs/main -> snapshots/<commit>/files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)
    return commit


READ = """
import json, sys
from trainer.lora.sync import checkpoint_weights
try:
    w = checkpoint_weights(sys.argv[1], ["model.layers.0.self_attn.k_proj.weight"])
    print(json.dumps({"shape": list(w["model.layers.0.self_attn.k_proj.weight"].shape)}))
except FileNotFoundError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.parametrize("repo_id", ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/NotCached"])
def test_hub_id_resolves_through_the_hf_cache_without_network(repo_id, tiny_model_dir, tmp_path):
    """The old glob of the model path found no files for a hub id: every LoRA worker died at its first sync."""
    hub_cache(tmp_path / "hf", "Qwen/Qwen2.5-1.5B-Instruct", tiny_model_dir)
    env = subprocess_env(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", READ, repo_id], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if repo_id == "Qwen/NotCached":
        assert "neither a local directory nor in the Hugging Face cache" in res["error"], res
    else:
        assert res == {"shape": [128, 128]}, res


def test_local_path_that_is_missing_says_so(tmp_path):
    from trainer.lora.sync import checkpoint_weights
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_weights(str(tmp_path / "nope"), ["x"])
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_weights(str(tmp_path), ["x"])
