"""The HF engine samples exactly the configured distribution and cuts completions by the eos rules.

The checkpoint here ships a generation_config (repetition_penalty, top_k=1, top_p, temperature,
no_repeat_ngram_size) that HF generate would merge in; the engine must ignore all of it (and say so).
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from common.config import GRPOConfig
from common.modeling import load_model, load_tokenizer
from trainer.engines import cut_at_eos, make_engine
from trainer.engines.hf import HFEngine

PROMPTS = [[5, 17, 33, 42], [7, 8, 9, 10, 11, 12], [100, 200, 300]]


@pytest.fixture(scope="module")
def noisy_checkpoint(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(tiny_model_dir, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc.update(repetition_penalty=5.0, top_k=1, top_p=0.1, temperature=0.05, no_repeat_ngram_size=1)
    (d / "generation_config.json").write_text(json.dumps(gc))
    return d


def manual_greedy(model, prompt, steps, eos):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                break
    return out


def engine_for(path, **kw):
    cfg = GRPOConfig(model=str(path), gen_backend="hf", temperature=1.0, gen_batch_size=8, **kw).validate()
    return make_engine(cfg, str(path))


def test_greedy_ignores_checkpoint_processors(noisy_checkpoint, caplog):
    with caplog.at_level(logging.INFO):
        eng = engine_for(noisy_checkpoint)
    assert "repetition_penalty" in caplog.text and "no_repeat_ngram_size" in caplog.text
    model = eng.model
    for p, s in zip(PROMPTS, eng.generate(PROMPTS, 1, max_new_tokens=20, greedy=True)):
        want = manual_greedy(model, p, 20, eng.eos_ids)
        assert s.completion_ids.tolist() == want
    # the test has teeth: plain generate (checkpoint config merged) decodes something else
    plain = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20, do_sample=False)[0, 4:].tolist()
    assert plain != manual_greedy(model, PROMPTS[0], 20, eng.eos_ids)[:len(plain)]
    assert model.generation_config.repetition_penalty == 5.0  # restored after each call


def test_sampling_is_not_truncated_by_checkpoint_top_k(noisy_checkpoint):
    eng = engine_for(noisy_checkpoint)
    torch.manual_seed(0)
    samples = eng.generate(PROMPTS[:1], 8, max_new_tokens=12)
    assert len({tuple(s.completion_ids.tolist()) for s in samples}) >= 6  # top_k=1 would give 1


def test_sampled_tokens_follow_the_raw_distribution(noisy_checkpoint):
    """Chi-square-free check: the first sampled token's empirical frequency tracks softmax(logits / T)."""
    eng = engine_for(noisy_checkpoint, top_k=0)
    torch.manual_seed(1)
    samples = eng.generate([PROMPTS[0]], 400, max_new_tokens=1)
    with torch.no_grad():
        probs = torch.softmax(eng.model(torch.tensor([PROMPTS[0]])).logits[0, -1].double(), -1)
    top = int(probs.argmax())
    freq = sum(int(s.completion_ids[0]) == top for s in samples) / len(samples)
    assert abs(freq - float(probs[top])) < 4 * (float(probs[top]) * (1 - float(probs[top])) / 400) ** 0.5 + 1e-3


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_and_truncation_rules(tiny_model_dir, pad_is_eos):
    tok = load_tokenizer(str(tiny_model_dir))
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    model = load_model(str(tiny_model_dir), dtype="float32")
    eos = list(range(0, 40))  # many stop ids: both outcomes happen in a few samples
    eng = HFEngine(model, tok, eos, temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=8)
    torch.manual_seed(2)
    samples = eng.generate(PROMPTS, 8, max_new_tokens=12)
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(8)]
    for s in samples:
        c = s.completion_ids.tolist()
        assert 1 <= len(c) <= 12 and not any(t in eos for t in c[:-1])
        assert s.truncated == (c[-1] not in eos) and (not s.truncated or len(c) == 12)
        assert s.logprobs is None  # HF: the rollout computes them with the trainer's forward
    assert any(s.truncated for s in samples) and any(not s.truncated for s in samples)


def test_cut_at_eos():
    ids = torch.tensor([5, 6, 2, 0, 0])
    c, trunc = cut_at_eos(ids, [0, 2], 5)
    assert c.tolist() == [5, 6, 2] and not trunc
    c, trunc = cut_at_eos(torch.tensor([5, 6, 7]), [0, 2], 3)
    assert c.tolist() == [5, 6, 7] and trunc


def test_hf_load_weights_subset_and_bad_names(tiny_model_dir):
    eng = engine_for(tiny_model_dir)
    name, p = next(iter(eng.model.named_parameters()))
    eng.load_weights([(name, torch.zeros_like(p))])
    assert float(p.abs().sum()) == 0.0
    emb = eng.model.get_input_embeddings().weight
    eng.load_weights([("lm_head.weight", torch.ones_like(emb))])  # tied: the alias lands in the embedding
    assert float(emb.sum()) == emb.numel()
    with pytest.raises(ValueError, match="not a parameter"):
        eng.load_weights([("nope.weight", torch.zeros(1))])


def test_unknown_backend_and_bad_values():
    with pytest.raises(ValueError, match="gen_backend"):
        GRPOConfig(gen_backend="sglang").validate()
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.5).validate()
    cfg = GRPOConfig()
    cfg.gen_backend = "sglang"
    with pytest.raises(ValueError, match="unknown gen_backend"):
        make_engine(cfg, "tiny")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_logprobs_from_generate_match_the_trainers_forward(tiny_model_dir, temperature):
    """With logprob_temperature the engine returns each sampled token's logprob from generate's own logits (issue 62:
    no second forward in the worker): the trainer's forward (common/logprobs.py) on the same rows, left-padded
    prompts of different lengths, with top_k/top_p sampling on (logprobs are the raw distribution at T), agrees
    to float32 rounding. Too large a call (LOGITS_BYTES) samples without them."""
    from common.logprobs import sequence_logprobs
    from trainer.engines import hf
    from trainer.rollout import pack_rows

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), dtype="float32")
    eng = HFEngine(model, tok, [tok.eos_token_id], temperature=temperature, top_p=0.9, top_k=20, gen_batch_size=8,
                   logprob_temperature=temperature)
    torch.manual_seed(3)
    samples = eng.generate(PROMPTS, 4, max_new_tokens=10)
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.completion_ids) for s in samples)
    ids, plens, clens = pack_rows([(s.prompt_ids, s.completion_ids) for s in samples], tok.pad_token_id)
    want, _ = sequence_logprobs(model, ids, plens, clens, temperature=temperature)
    for i, s in enumerate(samples):
        assert torch.allclose(s.logprobs, want[i, :len(s.logprobs)].float(), atol=1e-4, rtol=0)
    assert all(s.logprobs is None for s in eng.generate(PROMPTS, 2, max_new_tokens=4, greedy=True))
    old, hf.LOGITS_BYTES = hf.LOGITS_BYTES, 0
    try:
        assert all(s.logprobs is None for s in eng.generate(PROMPTS, 2, max_new_tokens=4))
    finally:
        hf.LOGITS_BYTES = old


def test_a_groups_prompt_is_prefilled_once_and_decodes_as_alone(tiny_model_dir):
    """n samples of a prompt share one prefill (issue 62): the body runs once over the distinct prompts (but their
    last token), and what generate decodes from that repeated cache is what each prompt decodes alone (greedy,
    left-padded prompts of different lengths, a call split across gen_batch_size chunks mid-group)."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), dtype="float32")
    eng = HFEngine(model, tok, [tok.eos_token_id], temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=5)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        shared = eng.generate(PROMPTS, 3, max_new_tokens=12, greedy=True)
    finally:
        hook.remove()
    # chunks of 5 rows: [p0 p0 p0 p1 p1] [p1 p2 p2 p2]: the first body call of each is the prefill of 2 prompts
    assert seen[0] == (2, 5) and (2, 5) in seen[1:]
    alone = [s for p in PROMPTS for s in eng.generate([p], 1, max_new_tokens=12, greedy=True)]
    for i, s in enumerate(shared):
        assert s.completion_ids.tolist() == alone[i // 3].completion_ids.tolist()
