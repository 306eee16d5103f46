"""TRL's min_p, repetition_penalty and generation_kwargs (issue 40; refused before): the config's sampling extras
reach the HF engine's GenerationConfig and the vLLM engine's SamplingParams alike, in rollouts (greedy eval keeps
the plain argmax), and change what is sampled."""
from __future__ import annotations

import pytest
import torch

from common.config import GRPOConfig
from common.modeling import load_model, load_tokenizer
from common.settings.knobs import load_config
from trainer.engines.hf import HFEngine


def test_config_gives_the_extras_and_refuses_owned_keys():
    c = load_config(GRPOConfig, ["--min_p", "0.05", "--repetition_penalty", "1.2", "--generation_kwargs",
                                 '{"presence_penalty": 0.5}'])
    assert c.sampling_extras() == {"min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.5}
    assert GRPOConfig().sampling_extras() == {"repetition_penalty": 1.0}
    for bad, match in [(["--min_p", "2"], "min_p must be"), (["--repetition_penalty", "0"], "repetition_penalty"),
                       (["--generation_kwargs", '{"temperature": 0.1}'], "may not set .'temperature'.")]:
        with pytest.raises(ValueError, match=match):
            load_config(GRPOConfig, bad)


def test_hf_engine_samples_with_them(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    cfg = load_config(GRPOConfig, ["--repetition_penalty", "1e6", "--min_p", "0.01", "--temperature", "1.0"])
    eng = HFEngine(model, tok, [tok.eos_token_id], temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=8,
                   extra=cfg.sampling_extras())
    gc, procs = eng._clean_config(False, 8)  # extras: generate's own sampling, not the Gumbel-max fast path
    assert (gc.do_sample, gc.repetition_penalty, gc.min_p, procs) == (True, 1e6, 0.01, None)
    gc, procs = eng._clean_config(True, 8)
    assert (gc.do_sample, gc.repetition_penalty, procs) == (False, 1.0, None)  # greedy eval: the model's argmax
    torch.manual_seed(0)
    prompt = tok("1 2 3 4")["input_ids"]
    for s in eng.generate([prompt], 4, max_new_tokens=12):  # a huge penalty: no token twice, none from the prompt
        ids = [t for t in s.completion_ids.tolist() if t != tok.eos_token_id]
        assert len(ids) == len(set(ids)) and not set(ids) & set(prompt), ids


def test_vllm_engine_samples_with_them():
    pytest.importorskip("vllm")
    from trainer.engines.vllm import VLLMEngine
    cfg = load_config(GRPOConfig, ["--min_p", "0.05", "--repetition_penalty", "1.3", "--generation_kwargs",
                                   '{"presence_penalty": 0.25}'])
    eng = VLLMEngine(None, None, [0], temperature=1.0, top_p=1.0, top_k=0, extra=cfg.sampling_extras())
    p = eng._params(4, 8, greedy=False)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty) == (0.05, 1.3, 0.25)
    assert eng._params(1, 8, greedy=True).repetition_penalty == 1.0
