"""The chat template's side of a session: a request's prompt ids, the tokens that continue a recorded conversation,
and the model's reply parsed into an OpenAI assistant message.

    ids = prompt_ids(tok, messages, tools)                  # the template's rendering, generation prompt added
    ids = continuation_ids(tok, stop_ids, reply, new, tools)  # the new messages' tokens after a recorded reply
    ids = turn_end_ids(tok, stop_ids)                       # what closes an assistant turn the model did not close
    msg = Replies(tok, model).parse(ids, prefix_ids, tools)  # {"role", "content", "tool_calls"?}

The model's own tokens are never re-tokenised: only the new messages are rendered, the way the tool loop renders a
tool turn (trainer/tools/multi_turn.py, TRL's `_get_tool_suffix_ids`): a dummy conversation ending in an assistant turn
(with the reply's real tool calls, whose names some templates print in the tool header), rendered with and without
the new messages, and the new tail kept. Tool calls are parsed by the model family's response template
(trainer/tools/templates.py) with transformers' `tokenizer.parse_response`, as the tool loop parses them.
"""
from __future__ import annotations

import logging

from trainer.tools.templates import set_response_template

log = logging.getLogger(__name__)
DUMMY_USER = {"role": "user", "content": "dummy"}


def _ids(tok, text: str) -> list[int]:
    """Rendered template text -> ids; the template writes its own special tokens (as encode_prompts does)."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def render(tok, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(tok, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """A request's messages as the model reads them: the chat template as is (no system prompt added: the agent
    owns its prompt), the assistant opener after them."""
    return _ids(tok, render(tok, messages, tools, True))


def _cut_after_last_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(ids) if t in stop_ids]
    return ids[:ends[-1] + 1] if ends else ids


def continuation_ids(tok, stop_ids: list[int], reply: dict, new: list[dict], tools: list[dict] | None
                     ) -> list[int]:
    """The tokens the template puts after a closed assistant turn (`reply`) for the messages `new` that follow it,
    the next assistant opener included. ValueError where the template re-renders the turn before them."""
    calls = [{"type": "function", "function": {"name": c["function"]["name"], "arguments": {}}}
             for c in reply.get("tool_calls") or []]
    dummy = [DUMMY_USER, {"role": "assistant", "content": "", **({"tool_calls": calls} if calls else {})}]
    prefix = _cut_after_last_stop(_ids(tok, render(tok, dummy, tools, False)), stop_ids)
    full = _ids(tok, render(tok, dummy + new, tools, True))
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders the turn before the new messages differently once they follow "
                         "it: the conversation cannot be continued without re-tokenising the model's tokens")
    return full[len(prefix):]


def turn_end_ids(tok, stop_ids: list[int]) -> list[int]:
    """What the template writes after an assistant message's text up to its turn-end token (Qwen: <|im_end|>):
    appended, loss masked, after a reply the model did not close (cut by its token budget or a stop string), so
    the next turn reads as the template renders a conversation."""
    marker = "Zq7 end-of-answer"
    text = render(tok, [DUMMY_USER, {"role": "assistant", "content": marker}], None, False)
    tail = _cut_after_last_stop(_ids(tok, text[text.rindex(marker) + len(marker):]), stop_ids)
    if not tail or tail[-1] not in stop_ids:
        raise ValueError("the chat template closes an assistant turn with none of the stop tokens")
    return tail


class Replies:
    """The model's turns as OpenAI assistant messages. The response template is the family's (None: a model whose
    template TRL 1.16 does not parse: its text is the content, and a request with tools is refused)."""

    def __init__(self, tok, model: str = "the model"):
        self.tok = tok
        try:
            self.family = set_response_template(tok, model)  # TRL's add_response_schema (the tiny model: Qwen3's)
            self.template = getattr(tok, "response_template", None) or getattr(tok, "response_schema", None)
        except ValueError as e:
            self.family, self.template, self.why = None, None, str(e)
        self.parses_calls = self.template is not None and "tool_calls" in self.template.get("fields", {})
        self._warned = False

    def parse(self, ids: list[int], prefix_ids: list[int], tools: list[dict] | None, calls: bool = True) -> dict:
        """{"role": "assistant", "content": str, "tool_calls"?: [{id?, type, function: {name, arguments: dict}}],
        "reasoning_content"?: str}. calls False (tool_choice "none"): the calls' text stays content."""
        plain = self.tok.decode(ids, skip_special_tokens=True)
        if self.template is None:
            return {"role": "assistant", "content": plain}
        try:
            parsed = self.tok.parse_response(self.tok.decode(ids, skip_special_tokens=False), schema=self.template,
                                             prefix=self.tok.decode(prefix_ids, skip_special_tokens=False),
                                             tools=tools)
        except (ValueError, TypeError, KeyError) as e:  # a region the parser cannot read: the text as content
            if not self._warned:
                self._warned = True
                log.info("agent endpoint: a reply the %s response template cannot parse is returned as plain text "
                         "(first of its kind: %s)", self.family, " ".join(str(e).split())[:200])
            return {"role": "assistant", "content": plain}
        got = [c for c in parsed.get("tool_calls") or [] if isinstance(c, dict)]
        msg = {"role": "assistant", "content": parsed.get("content") or ""}
        if calls and got and all(_is_call(c) for c in got):
            msg["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"].strip(),
                                                                   "arguments": c["function"].get("arguments") or {}}}
                                 for c in got]
        elif got:  # calls asked off, or one the parser half-read: what the model wrote is the content
            msg["content"] = plain
        if isinstance(parsed.get("reasoning_content"), str):
            msg["reasoning_content"] = parsed["reasoning_content"]
        return msg


def _is_call(c: dict) -> bool:
    fn = c.get("function") if isinstance(c.get("function"), dict) else None
    return fn is not None and isinstance(fn.get("name"), str) and bool(fn["name"].strip()) and \
        isinstance(fn.get("arguments") or {}, dict)
