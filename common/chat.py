"""What a chat template implies beyond the prompt text: its turn-end token, and prompts without a system turn.

A base checkpoint (eos = <|endoftext|>) trained on chat-templated prompts must also stop at the
template's turn end (<|im_end|> for Qwen), or its completions never end. And Qwen2.5's template
inserts a default system prompt whenever the messages have none, so "no system turn" has to be
cut out of the rendered text.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_SENTINEL = "\u2063SYS-SENTINEL\u2063"  # invisible separator: never in a real prompt


def _special_strings(tokenizer) -> list[str]:
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content))
    return sorted((s for s in out if s), key=len, reverse=True)


def chat_turn_end_id(tokenizer) -> int | None:
    """The special token the chat template puts right after an assistant message (None: no template,
    or the template closes turns with plain text)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Zq7 end-of-answer"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": marker}], tokenize=False)
    after = text[text.rindex(marker) + len(marker):]
    for s in _special_strings(tokenizer):
        if after.startswith(s):
            return int(tokenizer.convert_tokens_to_ids(s))
    return None


def render_without_system(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
    """The template's output for `messages` (no system message among them) with no system turn at all,
    also where the template would insert a default one. The system turn is found by rendering a
    sentinel system message and cutting from the turn opener before it to the next turn's opener."""
    if any(m.get("role") == "system" for m in messages):
        raise ValueError("render_without_system: messages already hold a system message")
    text = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}, *messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kw)
    where = text.find(_SENTINEL)
    role = text.rfind("system", 0, where)
    opener, at = None, -1
    for s in _special_strings(tokenizer):  # the last special token before the role name opens the turn
        p = text.rfind(s, 0, max(role, 0))
        if p > at:
            opener, at = s, p
    nxt = text.find(opener, where + len(_SENTINEL)) if opener else -1
    if where < 0 or role < 0 or opener is None or nxt < 0:
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} has no system turn "
                         "that can be cut out; use system_prompt '' (the template's default) or a text")
    return text[:at] + text[nxt:]
