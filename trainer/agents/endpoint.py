"""The endpoint's logic, apart from HTTP: sessions, and one call of a session served and recorded.

    ep = Endpoint(batcher, tokenizer, model="policy", max_new_tokens=256, max_prompt_length=512, stop_ids=[...])
    session = ep.open_session()                  # its id is the secret part of the rollout's base_url
    reply = ep.chat(session, body)               # openai.types.chat.ChatCompletion; ApiError (4xx) if refused
    reply = ep.text(session, body)               # openai.types.Completion
    ep.close_session(session)                    # later calls of it: 404

Limits, as the tool loop's: `max_new_tokens` (TRL's max_completion_length) bounds the sampled tokens of the whole
session and, as the tool loop counts them, a row's tokens after its prompt (its sampled and appended tokens: a row
fits the engine's max_model_len and the trainer's sequence length); `max_calls` (max_tool_calling_iterations) the
session's calls. A call past either is answered at once with no text and finish_reason `length`. The request's
own max_tokens / max_completion_tokens bounds its call within that. Sampling is the run's: a request's temperature,
top_p (and other sampling fields) are not applied, said once in the log per field.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time

from trainer.agents.chat import Replies, continuation_ids, prompt_ids, turn_end_ids
from trainer.agents.requests import ApiError, function_tools, normalized
from trainer.agents.responses import chat_completion, text_completion
from trainer.agents.session import Call, Segment, Session

log = logging.getLogger(__name__)
OVERRIDDEN = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "top_logprobs")


class Endpoint:
    def __init__(self, batcher, tokenizer, *, model: str, max_new_tokens: int, max_prompt_length: int,
                 stop_ids: list[int], max_calls: int | None = None, temperature: float = 1.0, top_p: float = 1.0):
        self.batcher, self.tok, self.model = batcher, tokenizer, model
        self.max_new_tokens, self.max_prompt_length, self.max_calls = max_new_tokens, max_prompt_length, max_calls
        self.stop_ids, self.run_sampling = list(stop_ids), {"temperature": temperature, "top_p": top_p}
        self.replies = Replies(tokenizer, model)
        self.turn_end = turn_end_ids(tokenizer, self.stop_ids) if getattr(tokenizer, "chat_template", None) else []
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._said: set[str] = set()

    # --- sessions ---------------------------------------------------------------------------------------------
    def open_session(self) -> Session:
        s = Session(secrets.token_urlsafe(24))  # 192 random bits: the rollout's base_url is its only key
        with self._lock:
            self.sessions[s.id] = s
        return s

    def coming(self) -> int:
        """Sessions whose agent has started but not yet called: the batcher waits for their first calls."""
        return sum(1 for s in list(self.sessions.values()) if s.started and not s.calls and not s.closed)

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.closed:
            raise ApiError(404, "no such session (it ended, or the URL is not a rollout's base_url)",
                           kind="not_found_error", code="session_not_found")
        return s

    def close_session(self, s: Session) -> None:
        s.closed = True
        with self._lock:
            self.sessions.pop(s.id, None)

    # --- calls ------------------------------------------------------------------------------------------------
    def chat(self, s: Session, body: dict):
        self._common(body)
        tools = function_tools(body)
        choice = body.get("tool_choice", "auto")
        if tools and not self.replies.parses_calls:
            raise ApiError(400, f"tools given, but the tool calls of {self.model} cannot be parsed: "
                                f"{getattr(self.replies, 'why', 'its template writes none')}", "tools")
        if tools and choice not in ("auto", "none"):
            self._say("tool_choice", f"tool_choice {choice!r} is not enforced (no constrained decoding): the model "
                                     f"calls a tool when it writes one, as with 'auto'")
        messages = normalized(body["messages"])
        asked = body.get("max_completion_tokens")
        limit = self._request_limit(asked if asked is not None else body.get("max_tokens"))
        with s.lock:
            new = s.extends_chat(messages, tools)
            if new is not None:
                seg = s.current
                added = ([] if seg.closed else list(self.turn_end)) + self._render(
                    continuation_ids, self.tok, self.stop_ids, seg.last_reply, new, tools)
            else:
                seg = Segment("chat", self._check_prompt(self._render(prompt_ids, self.tok, messages, tools)),
                              messages, tools)
                added = []
            call, text = self._generate(s, seg, added, limit, _stops(body.get("stop")))
            if call is None:
                return chat_completion(self, None, {"role": "assistant", "content": ""}, "length", body)
            context = call.context_ids
            if text is not None or call.finish_reason == "length":  # cut by a stop string or the budget: no calls
                reply = {"role": "assistant", "content": text if text is not None else
                         self.replies.parse(call.sampled_ids, context, tools, calls=False)["content"]}
            else:
                reply = self.replies.parse(call.sampled_ids, context, tools, calls=bool(tools) and choice != "none")
            for c in reply.get("tool_calls") or []:
                c["id"] = "call_" + secrets.token_hex(12)
            if reply.get("tool_calls"):
                call.finish_reason = "tool_calls"
            s.record(seg, added, call, reply, self.stop_ids, messages + [reply])
        return chat_completion(self, call, reply, call.finish_reason, body)

    def text(self, s: Session, body: dict):
        self._common(body)
        if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) != 1:
            raise ApiError(400, "echo, suffix and best_of > 1 are not served by this endpoint")
        prompt = _one_prompt(body.get("prompt"))
        limit = self._request_limit(body.get("max_tokens"))
        with s.lock:
            new = s.extends_text(prompt)
            if new is not None:
                seg = s.current
                added = self._text_ids(new, special=False)
            else:
                seg = Segment("text", self._check_prompt(self._text_ids(prompt, special=True)), prompt)
                added = []
            call, text = self._generate(s, seg, added, limit, _stops(body.get("stop")))
            if call is None:
                return text_completion(self, None, "", "length", body)
            reply = text if text is not None else self.tok.decode(call.sampled_ids, skip_special_tokens=True)
            history = prompt + (reply if isinstance(prompt, str) else call.sampled_ids)
            s.record(seg, added, call, reply, self.stop_ids, history)
        return text_completion(self, call, reply, call.finish_reason, body)

    def models(self) -> dict:
        from openai.types import Model
        return {"object": "list", "data": [Model(id=self.model, created=int(time.time()), object="model",
                                                 owned_by="grpo-trainer").model_dump(exclude_none=True)]}

    # --- helpers ----------------------------------------------------------------------------------------------
    def _generate(self, s: Session, seg: Segment, added: list[int], limit: int | None, stops: list[str]
                  ) -> tuple[Call | None, str | None]:
        """Serve one call within the session's limits: (the recorded call, the text before a stop string hit)
        or (None, None) when a limit is spent (nothing is generated or recorded)."""
        s.calls += 1
        room = min(self.max_new_tokens - s.sampled, self.max_new_tokens - len(seg.ids) - len(added))
        budget = room if limit is None else min(limit, room)
        if budget <= 0 or (self.max_calls is not None and s.calls > self.max_calls):
            s.refused += 1
            return None, None
        context = seg.prompt_ids + seg.ids + added
        sample, version = self.batcher.generate(context, budget)
        ids = sample.completion_ids.tolist()
        logps = None if sample.logprobs is None else sample.logprobs.tolist()[:len(ids)]
        ids, text = self._cut_at_stop(ids, stops)
        if logps is not None:
            logps = logps[:len(ids)]
        reason = "stop" if text is not None or not sample.truncated else "length"
        return Call(context, ids, logps, version, reason), text

    def _cut_at_stop(self, ids: list[int], stops: list[str]) -> tuple[list[int], str | None]:
        """OpenAI's `stop`: the sampled ids up to the token that completes the first stop string (what the model
        sampled, kept exact) and the text before it (the reply's content); (ids, None) when none occurs."""
        if not stops or not any(x in self.tok.decode(ids, skip_special_tokens=True) for x in stops):
            return ids, None
        for k in range(1, len(ids) + 1):
            text = self.tok.decode(ids[:k], skip_special_tokens=True)
            hits = [text.find(x) for x in stops if x in text]
            if hits:
                return ids[:k], text[:min(hits)]
        return ids, None

    def _render(self, fn, *args) -> list[int]:
        """The chat template's tokens for messages it may refuse (a tool message with no call before it, a
        template's own raise_exception): its refusal is the request's 400, not the endpoint's 500."""
        from jinja2 import TemplateError
        try:
            return fn(*args)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ApiError(400, f"the model's chat template cannot render these messages: {type(e).__name__}: "
                                f"{e}", "messages") from e

    def _text_ids(self, prompt, special: bool) -> list[int]:
        if isinstance(prompt, list):
            vocab = len(self.tok)
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be integers in [0, {vocab})", "prompt")
            return list(prompt)
        return list(self.tok(prompt, add_special_tokens=special)["input_ids"])

    def _check_prompt(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_length:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, over this run's max_prompt_length "
                                f"{self.max_prompt_length}", "messages", code="context_length_exceeded")
        return ids

    def _request_limit(self, n) -> int | None:
        if n is not None and n < 1:
            raise ApiError(400, f"max_tokens must be at least 1 (got {n})", "max_tokens")
        return n

    def _common(self, body: dict) -> None:
        if body.get("model") != self.model:
            raise ApiError(404, f"the model {body.get('model')!r} does not exist: this endpoint serves "
                                f"{self.model!r}", "model", kind="not_found_error", code="model_not_found")
        for key in OVERRIDDEN:
            v = body.get(key)
            if v is None or v == self.run_sampling.get(key) or (key == "top_logprobs" and v == 0):
                continue
            self._say(key, f"a request's {key}={v!r} is not applied: rollouts sample at the run's own settings "
                           f"({', '.join(f'{k}={x}' for k, x in self.run_sampling.items())})")

    def _say(self, key: str, message: str) -> None:
        """Once per kind per endpoint: what a request asked that the run does otherwise."""
        if key not in self._said:
            self._said.add(key)
            log.info("agent endpoint: %s (said once)", message)


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [x for x in stop if x]


def _one_prompt(prompt):
    """A completions prompt: a string or a list of token ids (a batch of one of either is taken as that one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise ApiError(400, "prompt must be one string or one list of token ids (a session is one rollout: one "
                        "prompt per call)", "prompt")
