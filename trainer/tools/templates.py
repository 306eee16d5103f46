"""Which response template parses a model's tool calls: TRL 1.16's `add_response_schema`, with its known chat
templates kept as data here (chat_templates/: the models' own templates and families.json, TRL is not imported).

    family, template = response_template(tokenizer, model)   # ValueError (one line, naming the model) if none

In order: the tokenizer's own `response_template` (a checkpoint that ships one, or one you set); else the chat
template compared exactly, as TRL compares it, with the templates of the families TRL 1.16 parses (Qwen2.5/Qwen3,
Qwen3.5/3.6, Llama-3.1/3.2 JSON, GLM-4-MoE, GPT-OSS, Nemotron 3, LFM2.5, Gemma 4, DeepSeek-R1-distill); the
embedded tiny model's template writes Qwen2.5's calls and parses as Qwen3's. Anything else is refused: its tool
calls would never run. Parsing itself is transformers' `tokenizer.parse_response` (trainer/tools/parsing.py).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "chat_templates"
TINY_FAMILY = "qwen3"  # common/tiny_model.py's template renders <tool_call>{json}</tool_call> as Qwen2.5 does


@lru_cache(maxsize=1)
def families() -> dict[str, dict]:
    """{family: {"chat_templates": [name, ...], "response_template": {...}}} from families.json."""
    return json.loads((DATA / "families.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def known_templates() -> dict[str, tuple[str, str]]:
    """{chat template text: (family, template file name)} of every template TRL 1.16 matches."""
    out = {}
    for family, spec in families().items():
        for name in spec["chat_templates"]:
            out[(DATA / f"{name}.jinja").read_text(encoding="utf-8")] = (family, name)
    return out


def _tiny_template() -> str:
    from common.tiny_model import CHAT_TEMPLATE
    return CHAT_TEMPLATE


def response_template(tokenizer, model: str = "the model") -> tuple[str, dict]:
    """(family, response template) for the tokenizer's tool calls; ValueError, one line, when none fits."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return "the tokenizer's own response_template", own
    chat = getattr(tokenizer, "chat_template", None)
    if isinstance(chat, str):
        if chat in known_templates():
            family, _ = known_templates()[chat]
            return family, families()[family]["response_template"]
        if chat == _tiny_template():
            return TINY_FAMILY, families()[TINY_FAMILY]["response_template"]
    raise ValueError(f"model {model}: its chat template is none of those whose tool calls TRL 1.16 parses "
                     f"({', '.join(families())}) and its tokenizer has no response_template, so its tool calls "
                     f"would never run: use a model of one of those families, or set tokenizer.response_template "
                     f"(transformers' response parsing) in the checkpoint")


def tool_response_template(tokenizer, model: str = "the model") -> tuple[str, dict]:
    """response_template(), and refused when the family cannot write a tool call (DeepSeek-R1-distill: TRL's
    supports_tool_calling refuses it for a run with tools)."""
    family, template = response_template(tokenizer, model)
    if "tool_calls" not in template.get("fields", {}):
        raise ValueError(f"model {model}: its chat template ({family}) parses no tool calls (it cannot write one): "
                         f"a run with tools needs a model that can call them")
    return family, template


def set_response_template(tokenizer, model: str = "the model") -> str:
    """As TRL's add_response_schema: set the tokenizer's response_template (parse_response reads it); the family."""
    family, template = tool_response_template(tokenizer, model)
    tokenizer.response_template = template
    return family
