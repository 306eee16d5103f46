"""Per-token logprobs (common/logprobs.py) against the model's own forward for architectures whose forward
processes the head's output (Gemma-2 soft-capping, Cohere logit_scale, Granite logits_scaling), random weights,
tiny configs; and at a temperature: log_softmax(logits / T). Float64 reference."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from common.logprobs import sequence_logprobs

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
MODELS = {
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=2.0)),
    "cohere": lambda: CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.37)),
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=3.5)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
}


def direct(model, ids, pl, cl, temperature):
    L = ids.shape[1]
    mask = (torch.arange(L)[None, :] < (pl + cl)[:, None]).long()
    with torch.no_grad():
        logp = (model(input_ids=ids, attention_mask=mask).logits.double() / temperature).log_softmax(-1)
    out = torch.zeros(ids.shape[0], int(cl.max()), dtype=torch.float64)
    for i in range(ids.shape[0]):
        p, c = int(pl[i]), int(cl[i])
        pos = torch.arange(p, p + c)
        out[i, :c] = logp[i, pos - 1, ids[i, pos]]
    return out


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_models_own_forward(arch, temperature):
    torch.manual_seed(0)
    model = MODELS[arch]().float().eval()
    with torch.no_grad():  # random init is near-uniform: widen the logits so capping/scaling matters
        model.get_output_embeddings().weight.mul_(40.0)
    pl, cl = torch.tensor([3, 5, 2]), torch.tensor([6, 2, 7])
    ids = torch.randint(0, 97, (3, 12))
    want = direct(model, ids, pl, cl, temperature)
    with torch.no_grad():
        got, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=4, temperature=temperature)
    m = torch.arange(int(cl.max()))[None, :] < cl[:, None]
    torch.testing.assert_close(got.double()[m], want[m], atol=2e-5, rtol=1e-5)
    if arch != "qwen2" and temperature == 1.0:  # without the model's processing the answer differs
        with torch.no_grad():
            raw = model.get_output_embeddings()(model.model(input_ids=ids).last_hidden_state).double()
        assert not torch.allclose(raw.log_softmax(-1)[0, 2, ids[0, 3]], want[0, 0], atol=1e-3)
