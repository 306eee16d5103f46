"""Prompt formats (chat, messages, raw, r1zero), column mapping for the common dataset layouts, and the
double-template guard (issue 13), from small files the tests write."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.modeling import load_tokenizer
from trainer.data.loading import ColumnSpec, load_examples
from trainer.data.prompt_formats import R1ZERO_TEMPLATE
from trainer.rewards.countdown import reward_countdown
from trainer.rollout import encode_prompts


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def texts(tok, examples, fmt: str, system_prompt="default") -> list[str]:
    kept, _ = encode_prompts(tok, examples, system_prompt, 10 ** 6, fmt)
    return [tok.decode(ids) for _, ids in kept]


# ----------------------------------------------------------------------------- layouts
def test_gsm8k_layout(tmp_path):
    exs = load_examples(write_jsonl(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "3+4=7\n#### 1,007"}]))
    assert exs[0].prompt == "How many?" and exs[0].ground_truth == "1007"
    assert exs[0].meta["solution"].endswith("#### 1,007")
    assert exs[0].columns == {"answer": "3+4=7\n#### 1,007"}  # TRL rewards see the raw column


def test_reasonrl_layout_keeps_extra_columns(tmp_path):
    row = {"prompt": "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n", "ground_truth": "4", "level": 2}
    ex = load_examples(write_jsonl(tmp_path / "r.jsonl", [row]))[0]
    assert ex.prompt == row["prompt"] and ex.ground_truth == "4" and ex.columns == {"ground_truth": "4", "level": 2}


def test_math_layout_reads_last_boxed(tmp_path):
    rows = [{"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"}]
    ex = load_examples(write_jsonl(tmp_path / "m.jsonl", rows))[0]
    assert ex.prompt == "Half of one?" and ex.ground_truth == "\\frac{1}{2}" and ex.meta == {"level": "Level 1"}


def test_countdown_layout_with_template(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"nums": [3, 5, 7], "target": 22}])
    with pytest.raises(ValueError, match="prompt_template"):
        load_examples(f)
    spec = ColumnSpec(prompt_template="Using the numbers {nums}, create an equation that equals {target}.")
    ex = load_examples(f, columns=spec)[0]
    assert ex.prompt == "Using the numbers [3, 5, 7], create an equation that equals 22."
    assert json.loads(ex.ground_truth) == {"nums": [3, 5, 7], "target": 22}
    assert reward_countdown("<answer>3*5+7</answer>", ex.ground_truth) == 1.0
    assert ex.columns == {"nums": [3, 5, 7], "target": 22}


def test_explicit_columns(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"q": "What?", "a": 12, "id": 1}])
    with pytest.raises(ValueError, match="prompt_column/answer_column"):
        load_examples(f)
    ex = load_examples(f, columns=ColumnSpec(prompt_column="q", answer_column="a"))[0]
    assert (ex.prompt, ex.ground_truth, ex.columns) == ("What?", "12", {"a": 12, "id": 1})
    with pytest.raises(ValueError, match="'nope'"):
        load_examples(f, columns=ColumnSpec(prompt_column="q", answer_column="nope"))


# ----------------------------------------------------------------------------- formats
def test_chat_format(tmp_path, tok):
    ex = load_examples(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "2+2", "ground_truth": "4"}]))
    t = texts(tok, ex, "chat")[0]
    assert t.startswith("<|im_start|>system\n")
    assert t.endswith("<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n")


def test_messages_format(tmp_path, tok):
    conv = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"prompt": conv, "ground_truth": "4"}])
    with pytest.raises(ValueError, match="'auto', 'messages' or 'trl'"):
        load_examples(f, columns=ColumnSpec(prompt_format="chat"))  # a list prompt in a chat run: told what fits
    ex = load_examples(f, columns=ColumnSpec(prompt_format="messages"))
    assert load_examples(f) == ex  # the default (auto) finds the conversation itself
    assert texts(tok, ex, "auto") == texts(tok, ex, "messages")
    want = "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n" \
           "<|im_start|>assistant\n"
    assert texts(tok, ex, "messages") == [want]  # no system prompt added by default
    assert texts(tok, ex, "messages", "Be brief.") == ["<|im_start|>system\nBe brief.<|im_end|>\n" + want]
    with pytest.raises(ValueError, match="messages"):
        load_examples(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user"}], "ground_truth": "1"}]),
                      columns=ColumnSpec(prompt_format="messages"))


def test_raw_format_is_verbatim(tmp_path, tok):
    p = "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
    ex = load_examples(write_jsonl(tmp_path / "r.jsonl", [{"prompt": p, "ground_truth": "4"}]))
    assert texts(tok, ex, "raw") == [p]


def test_chat_over_templated_rows_is_refused_naming_raw(tmp_path, tok):
    p = "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
    ex = load_examples(write_jsonl(tmp_path / "r.jsonl", [{"prompt": p, "ground_truth": "4"}]))
    with pytest.raises(ValueError, match="prompt_format 'raw'"):
        texts(tok, ex, "chat")


def test_r1zero_format_without_chat_template(tmp_path, tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = None  # a base model
    ex = load_examples(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is 2+2?", "ground_truth": "4"}]))
    t = texts(tok, ex, "r1zero")[0]
    assert t == R1ZERO_TEMPLATE.format(prompt="What is 2+2?")
    assert t.startswith("A conversation between User and Assistant.") and t.endswith("User: What is 2+2?. Assistant:")
    with pytest.raises(ValueError, match="r1zero"):
        texts(tok, ex, "chat")  # no chat template: the error points at r1zero/raw
