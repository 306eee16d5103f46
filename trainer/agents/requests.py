"""What an agent sends: OpenAI's request bodies, validated with the openai SDK's own TypedDicts, and OpenAI's error
shape for what does not validate.

    body = chat_request(raw_bytes)   # the SDK's CompletionCreateParams, iterables made lists; ApiError (4xx) if bad
    text = content_text(message)     # a message's content as one string (None -> "", text parts joined)

A request is refused (400, OpenAI's `{"error": {message, type, param, code}}`) for what it gets wrong and for what
this endpoint does not serve: n > 1 (a session is one rollout: its calls are one conversation) and content that is
not text. Sampling fields are accepted and overridden by the run's own (trainer/agents/endpoint.py says so once).
"""
from __future__ import annotations

import json
from functools import cache

from trainer.tools.types import one_line

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the endpoint refuses: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, one_line(message, 500), param, kind, code

    def body(self) -> dict:
        from openai.types.shared import ErrorObject
        err = ErrorObject(message=self.message, type=self.kind, param=self.param, code=self.code)
        return {"error": err.model_dump(exclude_none=False, exclude={"misalignment"})}


@cache
def _adapter(kind: str):
    from pydantic import TypeAdapter
    if kind == "chat":
        from openai.types.chat.completion_create_params import CompletionCreateParamsBase
        return TypeAdapter(CompletionCreateParamsBase)
    if kind == "completions":
        from openai.types.completion_create_params import CompletionCreateParamsBase as TextParams
        return TypeAdapter(TextParams)
    import openai.types.chat as chat_types
    return TypeAdapter(getattr(chat_types, kind))  # one message's param type, by role (ROLE_TYPES)


def _lists(v):
    """The SDK's params declare Iterable[...] fields, which pydantic validates lazily (a ValidatorIterator):
    walked into lists here, so every item is validated before the request is served."""
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) or (hasattr(v, "__next__") and not isinstance(v, (str, bytes))):
        return [_lists(x) for x in v]
    return v


def _errors_line(err) -> tuple[str, str | None]:
    """pydantic's errors in one line (the first few, union alternatives folded), and the first failing field."""
    seen, parts, param = set(), [], None
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not (isinstance(x, str) and x[:1].isupper()))
        param = param or (loc or None)
        if (loc, e["msg"]) not in seen and len(parts) < 3:
            seen.add((loc, e["msg"]))
            parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(parts), param


def parse_body(raw: bytes, kind: str) -> dict:
    """A request body (JSON bytes) -> the SDK's params for `kind` ("chat" or "completions"); ApiError 400 if not."""
    from pydantic import ValidationError
    try:
        data = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if kind == "chat":
        data = {**data, "messages": _check_messages(data.get("messages"))}
    try:
        body = _lists(_adapter(kind).validate_python(data))
    except ValidationError as e:
        message, param = _errors_line(e)
        raise ApiError(400, f"invalid request: {message}", param) from e
    if kind == "chat" and body.get("tools"):  # validated, but rendered as sent: pydantic drops a function's keys
        body["tools"] = [dict(t) for t in data["tools"]]  # the SDK does not declare (transformers' `return`), which
        # chat templates print with the schema's JSON: the prompt the model reads is the one the agent sent
    stream = data.get("stream")  # the SDK's base params leave it to their Streaming / NonStreaming variants
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"invalid request: stream: Input should be a valid boolean (got {stream!r})", "stream")
    body["stream"] = bool(stream)
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n={n}: this endpoint serves one choice per call (a session is one rollout; ask "
                            f"again for another sample)", "n")
    return body


ROLE_TYPES = {"system": "ChatCompletionSystemMessageParam", "developer": "ChatCompletionDeveloperMessageParam",
              "user": "ChatCompletionUserMessageParam", "assistant": "ChatCompletionAssistantMessageParam",
              "tool": "ChatCompletionToolMessageParam"}


def _check_messages(messages) -> list[dict]:
    """Each message against its role's own SDK type first, so an error names what is wrong with that message
    (against the union, pydantic lists every role's complaint). Fields sent as null are dropped, as OpenAI takes
    them (an SDK message's model_dump() carries refusal/audio/function_call/tool_calls: None)."""
    from pydantic import ValidationError
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise ApiError(400, f"messages.{i}: role must be one of {', '.join(ROLES)} (got {got!r})",
                           f"messages.{i}.role")
        m = {k: v for k, v in m.items() if v is not None}
        try:
            _lists(_adapter(ROLE_TYPES[m["role"]]).validate_python(m))
        except ValidationError as e:
            message, param = _errors_line(e)
            raise ApiError(400, f"messages.{i} ({m['role']}): {message}", f"messages.{i}.{param}") from e
        out.append(m)
    return out


def content_text(message: dict, where: str = "message") -> str:
    """A message's content as a string: None -> "", a list of text parts joined; other parts are refused."""
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    out = []
    for part in c:
        if part.get("type") != "text":
            raise ApiError(400, f"{where}: content part of type {part.get('type')!r}: only text is served", where)
        out.append(part["text"])
    return "".join(out)


def arguments_dict(arguments, where: str) -> dict:
    """A tool call's arguments as a dict (OpenAI sends a JSON string; TRL and the chat templates take a dict)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        out = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}: arguments are not JSON ({e.msg})", where) from e
    if not isinstance(out, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object, got {type(out).__name__}", where)
    return out


def normalized(messages: list[dict]) -> list[dict]:
    """Messages as the chat template and the session comparison take them: content a string (None <-> ""),
    tool-call arguments a dict (string <-> dict), only the fields that shape the conversation (role, content,
    name, tool_calls, tool_call_id), none that is None (the SDK's dumps carry refusal/audio/annotations: None)."""
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m["role"], "content": content_text(m, f"messages.{i}.content")}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = []
            for k, c in enumerate(calls):
                if c.get("type", "function") != "function":
                    raise ApiError(400, f"messages.{i}.tool_calls.{k}: only function tool calls are served")
                fn = c["function"]
                call = {"type": "function", "function": {"name": fn["name"], "arguments": arguments_dict(
                    fn.get("arguments"), f"messages.{i}.tool_calls.{k}.function.arguments")}}
                if c.get("id") is not None:
                    call["id"] = c["id"]
                msg["tool_calls"].append(call)
        out.append(msg)
    return out


def function_tools(body: dict) -> list[dict] | None:
    """The request's tools as the chat template takes them ({"type": "function", "function": {...}}); custom
    tools are refused (the model's template renders function schemas only)."""
    tools = body.get("tools")
    if not tools:
        return None
    for k, t in enumerate(tools):
        if t.get("type") != "function":
            raise ApiError(400, f"tools.{k}: only function tools are served (got type {t.get('type')!r})",
                           f"tools.{k}.type")
    return [{"type": "function", "function": dict(t["function"])} for t in tools]
