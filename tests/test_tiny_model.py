"""The embedded tiny model: `python -m common.tiny_model OUT_DIR` builds an ordinary HF directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    env = {"OMP_NUM_THREADS": "1", **os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "common.tiny_model", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"written to {out}" in r.stdout
    return out


@pytest.fixture(scope="module")
def loaded(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(built), AutoTokenizer.from_pretrained(built)


def test_build_writes_an_hf_directory(built):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (built / name).is_file(), name
    assert not list(built.glob("*.bin")) and not list(built.glob("*.pt"))  # safetensors only, no pickles


def test_is_a_qwen2_causal_lm(loaded):
    model, _ = loaded
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.model_type == "qwen2"


def test_reload_gives_the_same_logits(built, loaded, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = loaded
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    text = "<think> 12 + 30 = 42 </think> <answer> 42 </answer>"
    ids = torch.tensor([tok.encode(text)])
    assert tok2.encode(text) == ids[0].tolist()
    with torch.no_grad():
        a, b = model.eval()(ids).logits, again(ids).logits
    assert torch.equal(a, b)
    # and the directory as built loads identically too (no randomness at load time)
    third = AutoModelForCausalLM.from_pretrained(built).eval()
    with torch.no_grad():
        assert torch.equal(third(ids).logits, a)


def test_generate_produces_text(loaded):
    model, tok = loaded
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = tok([prompt, "<think> short"], return_tensors="pt", padding=True)
    assert set(enc) == {"input_ids", "attention_mask"}
    assert enc["attention_mask"][1, 0] == 0  # left padding, as generation needs
    torch.manual_seed(0)
    with torch.no_grad():
        # **enc straight from the tokenizer works: like Qwen's, it returns no token_type_ids
        # (which Qwen2's generate() would reject)
        out = model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=0.9,
                             pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 12
    new = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert all(isinstance(t, str) for t in new) and any(t for t in new)


@pytest.mark.parametrize("tag", TAGS)
def test_reasoning_tags_are_single_tokens(loaded, tag):
    _, tok = loaded
    ids = tok.encode(tag, add_special_tokens=False)
    assert len(ids) == 1, (tag, ids)
    assert tok.decode(ids) == tag
    assert tok.decode(ids, skip_special_tokens=True) == tag  # not "special": survives reward parsing
    # inside running text too
    text = f"x {tag} y"
    assert ids[0] in tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tag_ids_are_distinct(loaded):
    _, tok = loaded
    ids = [tok.convert_tokens_to_ids(t) for t in TAGS]
    assert len(set(ids)) == 4 and all(i is not None and i != tok.unk_token_id for i in ids)


def test_digits_are_single_tokens(loaded):
    _, tok = loaded
    for d in "0123456789":
        ids = tok.encode(d, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == d
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")  # numbers split one digit per token
    assert tok.decode(tok.encode("The answer is 1024.", add_special_tokens=False)) == "The answer is 1024."


def test_pad_differs_from_eos(loaded):
    model, tok = loaded
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    assert tok.eos_token_id in model.generation_config.eos_token_id
    assert tok.padding_side == "left"
    assert model.config.vocab_size == len(tok)


def test_chat_template(loaded):
    _, tok = loaded
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert text.endswith("<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert not no_gen.endswith("assistant\n") and text.startswith(no_gen)
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids and tok.eos_token_id in ids  # single-token markers


def test_tool_tokens_and_template_keep_the_single_turn_tokenisation():
    """Issue 32: the four Qwen2.5 tool tags are one token each and the template renders tools, tool calls and tool
    messages as Qwen2.5 does; what the single-turn demo tokenises and renders stays exactly as before."""
    from common.tiny_model import TOOL_TOKENS, build_tokenizer
    tok = build_tokenizer()
    for t in TOOL_TOKENS:
        assert len(tok.encode(t)) == 1, t
    assert tok.tokenize("3+4*2") == ["3", "+", "4", "*", "2"]
    assert tok.tokenize("<think> 12 </think>")[:3] == ["<think>", "Ġ", "1"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 3+4*2?"},
            {"role": "assistant", "content": "<think> x </think> <answer> 11 </answer>"}]
    before = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 3+4*2?<|im_end|>\n<|im_start|>assistant\n"
              "<think> x </think> <answer> 11 </answer><|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == before
    schema = {"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]},
            {"role": "tool", "name": "calculator", "content": "6"}]
    text = tok.apply_chat_template(conv, tools=[schema], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                         '"2*3"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response>'
                         '<|im_end|>\n<|im_start|>assistant\n')


def test_the_tokenizer_knows_tool_text():
    """Model v4: the tokenizer is trained on rendered tools sections and calls, so the tool demo's prompt (the
    built-in calculator listed) and its calls cost words, not characters (v3: 547 and 59 tokens). The tiny model
    mirrors the built-in tools' docstrings in its corpus (common/ does not import trainer/): if one changes, this
    says so."""
    from common.tiny_model import build_tokenizer
    from trainer.tools.schemas import load_tools

    tok = build_tokenizer()
    schemas = [t.schema for t in load_tools(["calculator"], None)]
    prompt = tok.apply_chat_template([{"role": "user", "content": "37*48+5"}], tools=schemas, tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    assert len(prompt) <= 220, len(prompt)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48+5"}}\n</tool_call>'
    assert len(tok.encode(call)) <= 26
    assert tok.tokenize("37*48+5") == ["3", "7", "*", "4", "8", "+", "5"]  # digits stay one token each
    from transformers.utils import get_json_schema

    from common.tiny_model import _calculator, _python
    for mirror, builtin in zip((_calculator, _python), load_tools(["calculator", "python"], None)):
        assert get_json_schema(mirror)["function"]["description"] == builtin.schema["function"]["description"]
        assert get_json_schema(mirror)["function"]["parameters"] == builtin.schema["function"]["parameters"]
