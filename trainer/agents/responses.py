"""What the endpoint answers, as the openai SDK's own types: ChatCompletion and Completion, their streamed chunks
(ChatCompletionChunk; Completion objects for text), usage and the sampler's logprobs.

A stream is the whole reply cut into OpenAI's chunk sequence once it is generated (the engine batches requests and
returns whole completions): the role, the content, each tool call, then the finish reason, and the usage chunk when
`stream_options.include_usage` asks for it.
"""
from __future__ import annotations

import json
import time
import uuid

from trainer.agents.session import Call


def _usage(call: Call | None):
    from openai.types import CompletionUsage
    prompt = len(call.context_ids) if call else 0
    done = len(call.sampled_ids) if call else 0
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def _tokens(ep, call: Call) -> list[str]:
    return [ep.tok.decode([t], skip_special_tokens=False) for t in call.sampled_ids]


def _chat_logprobs(ep, call: Call | None, body: dict):
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import ChoiceLogprobs
    if not body.get("logprobs") or call is None:
        return None
    if call.logprobs is None:
        ep._say("logprobs", "logprobs asked, but this engine samples without them (HF): responses carry none")
        return None
    return ChoiceLogprobs(content=[ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()),
                                                              top_logprobs=[])
                                   for t, lp in zip(_tokens(ep, call), call.logprobs)])


def chat_completion(ep, call: Call | None, reply: dict, finish: str, body: dict):
    from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
    from openai.types.chat.chat_completion import Choice
    calls = [ChatCompletionMessageFunctionToolCall(id=c["id"], type="function", function={
        "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])})
        for c in reply.get("tool_calls") or []]
    extra = {"reasoning_content": reply["reasoning_content"]} if "reasoning_content" in reply else {}
    message = ChatCompletionMessage(role="assistant", content=reply["content"], tool_calls=calls or None, **extra)
    return ChatCompletion(id="chatcmpl-" + uuid.uuid4().hex, object="chat.completion", created=int(time.time()),
                          model=ep.model, choices=[Choice(index=0, finish_reason=finish, message=message,
                                                          logprobs=_chat_logprobs(ep, call, body))],
                          usage=_usage(call))


def text_completion(ep, call: Call | None, text: str, finish: str, body: dict):
    from openai.types import Completion, CompletionChoice
    from openai.types.completion_choice import Logprobs
    logprobs = None
    if body.get("logprobs") is not None and call is not None:
        if call.logprobs is None:
            ep._say("logprobs", "logprobs asked, but this engine samples without them (HF): responses carry none")
        else:
            toks = _tokens(ep, call)
            offsets = [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
            logprobs = Logprobs(tokens=toks, token_logprobs=list(call.logprobs), text_offset=offsets,
                                top_logprobs=None)
    return Completion(id="cmpl-" + uuid.uuid4().hex, object="text_completion", created=int(time.time()),
                      model=ep.model, choices=[CompletionChoice(index=0, finish_reason=finish, text=text,
                                                                logprobs=logprobs)], usage=_usage(call))


def chat_chunks(done, include_usage: bool) -> list:
    """A ChatCompletion as the chunks a stream of it sends (then `data: [DONE]`, which the server writes)."""
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import (
        Choice,
        ChoiceDelta,
        ChoiceDeltaToolCall,
        ChoiceDeltaToolCallFunction,
        ChoiceLogprobs,
    )
    choice = done.choices[0]
    msg = choice.message

    def chunk(delta=None, finish=None, logprobs=None, usage=None, choices=True):
        return ChatCompletionChunk(id=done.id, object="chat.completion.chunk", created=done.created,
                                   model=done.model, usage=usage,
                                   choices=[Choice(index=0, delta=delta or ChoiceDelta(), finish_reason=finish,
                                                   logprobs=logprobs)] if choices else [])

    lp = ChoiceLogprobs(content=choice.logprobs.content) if choice.logprobs is not None else None
    out = [chunk(ChoiceDelta(role="assistant", content=""))]
    if msg.content:
        out.append(chunk(ChoiceDelta(content=msg.content), logprobs=lp))
    for k, c in enumerate(msg.tool_calls or []):
        out.append(chunk(ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
            index=k, id=c.id, type="function",
            function=ChoiceDeltaToolCallFunction(name=c.function.name, arguments=c.function.arguments))])))
    out.append(chunk(finish=choice.finish_reason))
    if include_usage:
        out.append(chunk(usage=done.usage, choices=False))
    return out


def text_chunks(done, include_usage: bool) -> list:
    """A Completion as a stream sends it: one chunk with the text and its finish reason (the SDK's CompletionChoice
    requires one), then the usage when asked."""
    from openai.types import Completion
    out = [done.model_copy(update={"usage": None})]
    if include_usage:
        out.append(Completion(id=done.id, object="text_completion", created=done.created, model=done.model,
                              choices=[], usage=done.usage))
    return out
