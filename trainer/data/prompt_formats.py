"""Prompt formats: how an example's prompt becomes the text the policy continues (`prompt_format`).

    auto      (the default) messages where the prompt is a list of messages, else chat: TRL's conversational
              data needs no flag
    chat      question + system prompt through the tokenizer's chat template (the default)
              {"question": "What is 2+3?", "answer": "... #### 5"}
    messages  the row's prompt is a conversation, few-shot turns included, templated as is (a system prompt is
              added only when the config sets one explicitly)
              {"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "2+3?"}], "ground_truth": "5"}
    raw       the prompt string verbatim: it is already templated (ReasonRL's JSONL)
              {"prompt": "<|im_start|>user\\n2+3?<|im_end|>\\n<|im_start|>assistant\\n", "ground_truth": "5"}
    r1zero    the plain-text DeepSeek-R1-Zero template for base models (no chat template needed)
              "A conversation between User and Assistant. ... User: {prompt}. Assistant:"
    trl       as TRL 1.16's GRPOTrainer: a text prompt as it is, tokenized with the tokenizer's special tokens
              (a BOS for Llama: trainer/rollout.py encode_prompts); a conversation through the chat template,
              with no system prompt added (configs/trl_defaults.json sets it)

Every templated prompt gets the config's chat_template_kwargs (TRL's name; Qwen3's {"enable_thinking": false}).

A `chat` run over prompts that already carry the template's markers stops with an error naming `raw`:
templating twice trains on a prompt the model never sees at inference.
"""
from __future__ import annotations

from common.chat import render_without_system
from common.prompts import SYSTEM_PROMPT

PROMPT_FORMATS = ("auto", "chat", "messages", "raw", "r1zero", "trl")

# The R1-Zero template as in DeepSeek-R1 (Table 1) and Dr. GRPO's understand-r1-zero.
R1ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>. User: {prompt}. Assistant:"
)

_PROBE = "\x00probe\x00"


def check_messages(prompt, where: str) -> None:
    """A `messages` prompt is a non-empty list of {"role": str, "content": str}."""
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not ok:
        raise ValueError(f"{where}: prompt_format 'messages' needs the prompt as a list of "
                         f'{{"role": ..., "content": ...}} messages, got {str(prompt)[:200]!r}')


def _need_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template; use an "
                         f"instruct/chat model, set tokenizer.chat_template, or use prompt_format 'r1zero' (plain "
                         f"text for base models) or 'raw' (prompts already templated)")


def template_markers(tokenizer) -> list[str]:
    """Strings the chat template wraps around a message: its special tokens, else its literal framing."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False,
                                         add_generation_prompt=True)
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if len(t) > 1 and t in text]
    specials += [t for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if getattr(t, "special", False) and len(str(t)) > 1 and str(t) in text]
    markers = sorted({str(t) for t in specials})
    if not markers:  # a template of plain text ("[INST]", "### User:"): its framing around the content
        before, _, after = text.partition(_PROBE)
        markers = [m.strip() for m in (before, after) if len(m.strip()) >= 3]
    return markers


def check_not_templated(tokenizer, prompt: str) -> None:
    found = [m for m in template_markers(tokenizer) if m in prompt]
    if found:
        raise ValueError(f"prompt_format 'chat' but the prompt already contains the chat template's markers "
                         f"{found[:3]}: it is already templated (e.g. ReasonRL's JSONL); use prompt_format 'raw' "
                         f"to take it verbatim. Prompt: {prompt[:200]!r}")


def resolve_format(prompt_format: str, prompt) -> str:
    """The format of this prompt: 'auto' is messages for a message list, else chat; others are themselves."""
    if prompt_format == "auto":
        return "messages" if isinstance(prompt, list) else "chat"
    return prompt_format


def build_prompt(tokenizer, prompt, system_prompt: str | None = SYSTEM_PROMPT, prompt_format: str = "chat",
                 tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The text the policy continues. `system_prompt` is used by chat (and messages, when given; callers
    pass None there for the config's 'default'); raw and r1zero ignore it (config.validate refuses one).
    `tools`: JSON schemas the chat template renders into the prompt (`apply_chat_template(tools=...)`, as TRL
    does); with tools, system_prompt 'none' keeps the template's system turn, where it lists them.
    template_kwargs: more arguments of the chat template (TRL's chat_template_kwargs)."""
    prompt_format = resolve_format(prompt_format, prompt)
    kw = dict(template_kwargs or {})
    if prompt_format == "trl":  # TRL 1.16 _tokenize_prompts: text as it is, messages templated, nothing added
        if not isinstance(prompt, list):
            return prompt
        check_messages(prompt, "prompt")
        _need_template(tokenizer)
        return _render(tokenizer, list(prompt), tools, kw)
    if prompt_format == "raw":
        return prompt
    if prompt_format == "r1zero":
        return R1ZERO_TEMPLATE.format(prompt=prompt.strip().rstrip("."))
    if prompt_format == "messages":
        check_messages(prompt, "prompt")
        _need_template(tokenizer)
        messages = list(prompt)
        if system_prompt == "none" and not tools:
            return render_without_system(tokenizer, messages, **kw)
        if system_prompt and system_prompt != "none":
            if messages[0]["role"] == "system":
                raise ValueError("system_prompt is set but the conversation already has a system message; "
                                 "set system_prompt to '' to keep the dataset's own")
            messages.insert(0, {"role": "system", "content": system_prompt})
        return _render(tokenizer, messages, tools, kw)
    if prompt_format != "chat":
        raise ValueError(f"unknown prompt_format {prompt_format!r}; use one of {PROMPT_FORMATS}")
    _need_template(tokenizer)
    check_not_templated(tokenizer, prompt)
    if system_prompt == "none" and not tools:  # no system turn, even where the template inserts one (Qwen2.5)
        return render_without_system(tokenizer, [{"role": "user", "content": prompt}], **kw)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt != "none" else []
    messages.append({"role": "user", "content": prompt})
    return _render(tokenizer, messages, tools, kw)


def prompt_as_seen(prompt, system_prompt: str | None, prompt_format: str):
    """The prompt as the policy saw it, in TRL's terms (what a reward model scores it with): the messages, system
    prompt included, where build_prompt sent it through the chat template (chat, messages), the text where it did
    not (trl's text prompts, raw, r1zero's template). system_prompt as the config says it ('default': the R1-style
    prompt for chat, none for messages; encode_prompts' rule)."""
    fmt = resolve_format(prompt_format, prompt)
    system = (SYSTEM_PROMPT if fmt == "chat" else None) if system_prompt == "default" else system_prompt
    added = [{"role": "system", "content": system}] if system and system != "none" else []
    if fmt == "chat":
        return added + [{"role": "user", "content": prompt}]
    if fmt == "messages":
        return added + list(prompt) if not (added and prompt and prompt[0].get("role") == "system") else list(prompt)
    if fmt == "r1zero":
        return R1ZERO_TEMPLATE.format(prompt=prompt.strip().rstrip("."))
    return prompt  # trl (a text as it is, a conversation as it is), raw


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, kw: dict) -> str:
    # tools=None, never []: some templates (Llama) render their tool boilerplate for an empty list (TRL's note)
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **kw)
