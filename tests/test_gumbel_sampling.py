"""The HF engine's plain sampler (trainer/engines/gumbel.py): generate's greedy loop over Gumbel-noised scores
draws from exactly the distribution generate's own do_sample draws from (its warpers, its order), at every
temperature / top_k / top_p, and the engine takes that path only for the plain sampler."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from common.modeling import load_model, load_tokenizer
from trainer.engines.gumbel import gumbel_sampler, plain_sampler
from trainer.engines.hf import HFEngine

SCORES = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.85),
                                                     (0.7, 4, 0.9)])
def test_the_draws_follow_generates_own_sampling_distribution(tiny_model_dir, temperature, top_k, top_p):
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    hf = model._get_logits_processor(GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k,
                                                      top_p=top_p, num_beams=1), input_ids_seq_length=1)
    ids = torch.zeros(1, 1, dtype=torch.long)
    expected = torch.softmax(hf(ids, SCORES[None].clone()).double(), -1)[0]  # what multinomial would draw from
    n = 200_000
    torch.manual_seed(0)
    rows = gumbel_sampler(temperature, top_k, top_p)(torch.zeros(n, 1, dtype=torch.long), SCORES.repeat(n, 1))
    freq = torch.bincount(rows.argmax(-1), minlength=len(SCORES)).double() / n  # generate's greedy pick
    bound = 5 * (expected * (1 - expected) / n).sqrt() + 1e-4
    assert (freq - expected).abs().le(bound).all(), (freq, expected)
    assert freq[expected == 0].sum() == 0  # what top_k / top_p cut is never drawn
    if temperature != 1.0:  # the check can tell: the untempered softmax is another distribution
        assert not (freq - torch.softmax(SCORES.double(), -1)).abs().le(bound).all()


def test_only_the_plain_sampler_takes_the_path(tiny_model_dir):
    assert plain_sampler({}) and plain_sampler({"repetition_penalty": 1.0})
    assert not plain_sampler({"repetition_penalty": 1.2}) and not plain_sampler({"repetition_penalty": 1.0,
                                                                                  "min_p": 0.05})
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    eng = HFEngine(model, tok, [tok.eos_token_id], temperature=0.9, top_p=1.0, top_k=0, gen_batch_size=8,
                   extra={"repetition_penalty": 1.0})
    gc, procs = eng._clean_config(False, 8)
    assert gc.do_sample is False and procs is not None and len(procs) == 1
    torch.manual_seed(0)
    samples = eng.generate([tok("1 2 3")["input_ids"]], 8, max_new_tokens=10)
    assert len({tuple(s.completion_ids.tolist()) for s in samples}) >= 6  # samples, not 8 copies of the argmax
