"""LoRA pieces without processes: peft wrapping, adapter-only weight sync and the worker-side merge."""
from __future__ import annotations

import pytest
import torch

from common.config import GRPOConfig
from common.logprobs import sequence_logprobs
from common.modeling import load_model
from common.weights.blob import ParametersBody, blob_metadata, tensors_from_blob
from common.weights.sync import WeightSync
from trainer.lora.adapters import (
    LoraMerger,
    adapter_metadata,
    adapter_tensors,
    base_name,
    is_lora,
    merged_tensors,
    trainable_summary,
    wrap_lora,
)


def lora_policy(tiny_model_dir, r: int = 4, seed: int = 0):
    """The tiny model with LoRA adapters whose B is random (peft starts B at 0: the merge would be trivial)."""
    cfg = GRPOConfig(lora_r=r, lora_alpha=8.0).validate()
    model = wrap_lora(load_model(str(tiny_model_dir), dtype="float32", trainable=True), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def some_tokens(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (3, 14), generator=g), torch.tensor([4, 5, 6]), torch.tensor([10, 6, 8])


def test_only_adapters_train(tiny_model_dir):
    model = lora_policy(tiny_model_dir)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    s = trainable_summary(model)
    assert s["trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < s["trainable_fraction"] < 0.2
    targets = {n.split(".")[-4] for n in trainable}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ValueError, match="lora_target_modules"):
        wrap_lora(load_model(str(tiny_model_dir), dtype="float32"), GRPOConfig(lora_r=2, lora_target_modules=["nope"]))


def test_bad_lora_config_is_refused():
    for bad in (dict(lora_r=-1), dict(lora_r=4, lora_alpha=0.0), dict(lora_dropout=1.0),
                dict(lora_r=4, lora_target_modules=[])):
        with pytest.raises(ValueError, match="lora"):
            GRPOConfig(**bad).validate()


def test_base_names():
    assert base_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") == \
        "model.layers.0.mlp.up_proj.lora_A.weight"
    assert base_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"


def test_merged_tensors_equal_peft_merge(tiny_model_dir):
    model = lora_policy(tiny_model_dir)
    ours = dict(merged_tensors({base_name(n): p.detach().clone() for n, p in model.named_parameters()},
                               dict(adapter_tensors(model)), float(adapter_metadata(model)["lora_scaling"])))
    peft_merged = dict(model.merge_and_unload().named_parameters())
    assert len(ours) == 4 * 7  # 4 layers x 7 projections
    diff = max(float((ours[n] - peft_merged[n]).abs().max()) for n in ours)
    assert diff < 1e-6, diff


def test_adapter_sync_through_a_directory_makes_the_worker_equal_the_policy(tiny_model_dir, tmp_path):
    """Trainer publishes adapters only; a worker holding the plain base model merges them twice (from W0 each
    time) and then computes the policy's logprobs."""
    policy = lora_policy(tiny_model_dir, seed=1)
    worker = load_model(str(tiny_model_dir), dtype="float32")
    pub = WeightSync(sync_dir=str(tmp_path))
    fol = WeightSync(sync_dir=str(tmp_path), adapter_loader=LoraMerger().apply)
    ids, plens, clens = some_tokens()
    for version, seed in ((1, 1), (2, 2)):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + hash(n) % 1000)) * .05)
        _, nbytes = pub.publish(policy, version, named=adapter_tensors(policy), metadata=adapter_metadata(policy))
        assert fol.follow(worker) == version
        with torch.no_grad():
            want, _ = sequence_logprobs(policy, ids, plens, clens)
            got, _ = sequence_logprobs(worker, ids, plens, clens)
        assert float((want - got).abs().max()) < 1e-5
    full = len(ParametersBody(worker))
    print(f"adapter sync {nbytes} bytes vs full weights {full} bytes: {full / nbytes:.1f}x fewer")
    assert nbytes < full / 5


def test_adapter_blob_carries_its_metadata(tiny_model_dir):
    policy = lora_policy(tiny_model_dir)
    blob = bytearray(b"".join(ParametersBody(policy, named=adapter_tensors(policy), metadata=adapter_metadata(policy))))
    meta = blob_metadata(blob)
    assert meta["format"] == "lora_adapter" and float(meta["lora_scaling"]) == pytest.approx(2.0)
    tensors = tensors_from_blob(blob)
    assert set(tensors) == {base_name(n) for n, p in policy.named_parameters() if p.requires_grad}


def test_follower_without_adapter_loader_refuses_adapter_blobs(tiny_model_dir, tmp_path):
    policy = lora_policy(tiny_model_dir)
    WeightSync(sync_dir=str(tmp_path)).publish(policy, 1, named=adapter_tensors(policy),
                                               metadata=adapter_metadata(policy))
    with pytest.raises(ValueError, match="adapter"):
        WeightSync(sync_dir=str(tmp_path)).follow(load_model(str(tiny_model_dir), dtype="float32"))


def test_is_lora_without_importing_peft(tiny_model_dir):
    """A run without LoRA never imports peft to ask (each rank's is_lora did: ~0.2 CPU-s); a LoRA policy is one."""
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    code = ("import sys\nfrom common.modeling import load_model\nfrom trainer.lora.adapters import is_lora\n"
            f"m = load_model({str(tiny_model_dir)!r}, dtype='float32')\n"
            "print(is_lora(m), 'peft' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr[-2000:]
    assert is_lora(lora_policy(tiny_model_dir)) and not is_lora(load_model(str(tiny_model_dir), dtype="float32"))
