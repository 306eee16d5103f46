"""trainer/deepspeed_policy.py: prepare_policy's gradient checkpointing really recomputes (the model is in train mode);
ds_config_for's precision comes from --bf16 over ds_config."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO

from common.config import GRPOConfig
from common.logprobs import sequence_logprobs
from common.modeling import load_model
from trainer.deepspeed_policy import ds_config_for, prepare_policy


def _layer_calls_and_grads(model_dir, checkpointing: bool):
    """Forward + backward of the loss path; returns decoder-layer forward calls and the embedding gradient."""
    model = prepare_policy(load_model(str(model_dir), dtype="float32", trainable=True),
                           GRPOConfig(gradient_checkpointing=checkpointing))
    calls = []
    for layer in model.model.layers:  # a pre-hook: recomputation stops early, before the layer's end
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 20), generator=g)
    logps, _ = sequence_logprobs(model, ids, torch.tensor([8, 6, 10]), torch.tensor([12, 9, 10]), chunk_tokens=16)
    logps.sum().backward()
    return len(calls), model.get_input_embeddings().weight.grad.clone(), len(model.model.layers)


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradient(tiny_model_dir):
    plain, g_plain, n_layers = _layer_calls_and_grads(tiny_model_dir, checkpointing=False)
    ckpt, g_ckpt, _ = _layer_calls_and_grads(tiny_model_dir, checkpointing=True)
    assert plain == n_layers  # one forward per layer
    # from_pretrained leaves the model in eval mode, where transformers skips checkpointing: every
    # activation was kept and a 0.5B run ran out of memory. Recomputation runs each layer again in backward.
    assert ckpt == 2 * n_layers
    assert torch.allclose(g_plain, g_ckpt, atol=1e-6, rtol=1e-5)


def test_prepared_policy_is_in_train_mode(tiny_model_dir):
    model = prepare_policy(load_model(str(tiny_model_dir), dtype="float32", trainable=True), GRPOConfig())
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("in_file, knob, expected", [
    ("auto", None, False),  # ds_config.json's auto: bf16 only on GPUs
    ("auto", True, True), (True, None, True), (True, False, False), (False, True, True),
])
def test_bf16_knob_overrides_ds_config_on_cpu(tmp_path, in_file, knob, expected):
    ds = json.loads((REPO / "ds_config.json").read_text())
    ds["bf16"] = {"enabled": in_file}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    out = ds_config_for(GRPOConfig(ds_config=str(path), bf16=knob), on_gpu=False)
    assert out["bf16"]["enabled"] is expected
    assert out["zero_optimization"] == ds["zero_optimization"]  # the rest of the file is kept
