"""Prompt format `trl` (issue 40): prompts reach the model exactly as TRL 1.16's GRPOTrainer sends them
(`_tokenize_prompts`): a text prompt as it is, tokenized with the tokenizer's special tokens (a BOS for Llama); a
conversation through the chat template with no system prompt added; chat_template_kwargs reach the template."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from common.config import GRPOConfig
from common.modeling import load_tokenizer
from common.settings.knobs import load_config
from trainer.data.loading import ColumnSpec, load_examples
from trainer.rollout import encode_prompts

TRL_DEFAULTS = Path(__file__).resolve().parents[1] / "configs" / "trl_defaults.json"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def ids_of(tok, examples, fmt="trl", system="default", kwargs=None) -> list[list[int]]:
    kept, _ = encode_prompts(tok, examples, system, 10 ** 6, fmt, template_kwargs=kwargs)
    return [ids for _, ids in kept]


def test_text_prompt_is_tokenized_as_trl_does(tmp_path, tok):
    exs = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 2+3?", "ground_truth": "5"}]),
                        columns=ColumnSpec(prompt_format="trl"))
    got = ids_of(tok, exs)[0]
    assert got == tok(text=["What is 2+3?"])["input_ids"][0]  # TRL: processing_class(text=prompts)
    assert tok.decode(got) == "What is 2+3?"  # no chat template, no system prompt
    assert ids_of(tok, exs, "chat")[0] != got  # the default format templates it (and adds the R1 prompt)


def test_text_prompt_gets_the_tokenizers_bos_like_llama(tmp_path, tok):
    """A tokenizer that adds a BOS (Llama's post-processor): TRL's prompt ids start with it; ours too."""
    from tokenizers.processors import TemplateProcessing
    llama = copy.deepcopy(tok)
    bos = llama.eos_token  # any special token stands in for <s>
    llama._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos,
                                                         llama.convert_tokens_to_ids(bos))])
    exs = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Hi there", "ground_truth": "5"}]))
    got = ids_of(llama, exs)[0]
    assert got == llama(text=["Hi there"])["input_ids"][0]
    assert got[0] == llama.convert_tokens_to_ids(bos) and got[1:] == tok("Hi there")["input_ids"]


def test_conversation_goes_through_the_chat_template_with_no_system_prompt_added(tmp_path, tok):
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "2+3?"}]
    exs = load_examples(write_jsonl(tmp_path / "m.jsonl", [{"prompt": msgs, "ground_truth": "5"}]),
                        columns=ColumnSpec(prompt_format="trl"))
    want = tok.apply_chat_template([msgs], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids_of(tok, exs)[0] == list(want["input_ids"][0])  # TRL's exact call
    assert "<think>" not in tok.decode(ids_of(tok, exs)[0])  # no R1 system prompt


def test_chat_template_kwargs_reach_the_template(tmp_path, tok):
    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                       "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    exs = load_examples(write_jsonl(tmp_path / "m.jsonl", [{"prompt": msgs, "ground_truth": "5"}]),
                        columns=ColumnSpec(prompt_format="trl"))
    assert "<nothink>" in t.decode(ids_of(t, exs, kwargs={"enable_thinking": False})[0])
    assert "<nothink>" not in t.decode(ids_of(t, exs)[0])
    text = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "ground_truth": "5"}]))
    assert "<nothink>" in t.decode(ids_of(t, text, "chat", kwargs={"enable_thinking": False})[0])  # ours too
    c = load_config(GRPOConfig, ["--chat_template_kwargs", '{"enable_thinking": false}'])
    assert c.chat_template_kwargs == {"enable_thinking": False}


def test_trl_defaults_file_sets_the_trl_format():
    c = load_config(GRPOConfig, ["--config", str(TRL_DEFAULTS)])
    assert c.prompt_format == "trl" and c.use_bias_correction_kl is True
    assert GRPOConfig().prompt_format == "auto"  # ours stays simple_GRPO's (docs/trl.md says so)
    with pytest.raises(ValueError, match="system_prompt cannot be added"):
        load_config(GRPOConfig, ["--prompt_format", "trl", "--system_prompt", "Be brief."])
