"""What a LoRA worker sends its engine (fused layers complete), and W0 read from a hub id through the HF cache."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def adapter_blob(base_dir, seed: int):
    """A trainer's adapter sync: LoRA (float32, random B) on the default targets of the model in base_dir."""
    from test_lora import lora_policy

    from trainer.lora.adapters import adapter_metadata, adapter_tensors
    policy = lora_policy(base_dir, seed=seed)
    return {n: t.clone() for n, t in adapter_tensors(policy)}, adapter_metadata(policy)


def checkpoint_tensors(model_dir) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("ckpt_dtype", ["bfloat16", "float32"])
def test_bf16_worker_keeps_w0_in_bf16_and_merges_correctly(ckpt_dtype, tiny_model_dir, tmp_path):
    """Issue 30 §4: a LoRA worker kept W0 of every target module in float32 (~26 GB host memory for 7B) whatever
    its own dtype. A bf16 worker (the real HF engine; vLLM's path is the same policy_loader) now keeps bf16, half
    the bytes, and its merged weights are bf16(W0 + s B A) computed in float32: bit-equal to the old result for a
    bf16 checkpoint (Qwen's), within bf16 rounding of W0 for a float32 one. Old code: kept float32, 2x the bytes."""
    import torch

    from common.config import GRPOConfig
    from common.modeling import load_model, load_tokenizer
    from trainer.engines import make_engine
    from trainer.lora.sync import policy_loader

    model_dir = tmp_path / "base"
    load_model(str(tiny_model_dir), dtype=ckpt_dtype).save_pretrained(model_dir)
    load_tokenizer(str(tiny_model_dir)).save_pretrained(model_dir)
    engine = make_engine(GRPOConfig(model=str(model_dir), gen_backend="hf", worker_dtype="bfloat16",
                                    device="cpu").validate(), str(model_dir))
    assert engine.weight_dtype() == torch.bfloat16
    tensors, metadata = adapter_blob(model_dir, seed=3)
    apply = policy_loader(engine, str(model_dir))
    apply(tensors, metadata)

    kept = apply.merger.base
    targets = sorted({f"{k.rsplit('.lora_', 1)[0]}.weight" for k in tensors})
    assert set(targets) <= set(kept) and len(targets) == 4 * 7  # 4 layers x 7 projections (+ q/k/v biases)
    assert {t.dtype for t in kept.values()} == {torch.bfloat16}
    assert apply.merger.base_bytes() == sum(t.numel() for t in kept.values()) * 2  # float32 would be x 4

    w0 = checkpoint_tensors(model_dir)
    params = dict(engine.model.named_parameters())
    s = float(metadata["lora_scaling"])
    for name in targets:
        m = name.rsplit(".", 1)[0]
        ref = w0[name].float() + s * (tensors[f"{m}.lora_B.weight"].float() @ tensors[f"{m}.lora_A.weight"].float())
        got = params[name].detach()
        assert got.dtype == torch.bfloat16
        if ckpt_dtype == "bfloat16":  # W0 exact in bf16: the same single rounding as the float32 copy gave
            assert torch.equal(got, ref.to(torch.bfloat16)), name
        else:  # W0 rounded to bf16 once more: within bf16's relative step (2^-8) of |W0| and |W|
            bound = 2.0 ** -8 * (w0[name].abs() + ref.abs())
            assert bool(((got.float() - ref).abs() <= bound).all()), name
    # a second sync merges from the kept W0 again, not from the first merge's result
    tensors2, metadata2 = adapter_blob(model_dir, seed=4)
    apply(tensors2, metadata2)
    name = targets[0]
    m = name.rsplit(".", 1)[0]
    ref = w0[name].float() + s * (tensors2[f"{m}.lora_B.weight"].float() @ tensors2[f"{m}.lora_A.weight"].float())
    assert float((params[name].detach().float() - ref).abs().max()) <= float(2.0 ** -8 * (
        w0[name].abs() + ref.abs()).max())
