"""Agents' rollouts: an OpenAI-compatible endpoint in the generation worker, recording each rollout token-exact.

    server = serve(engine, tokenizer, model="policy", max_new_tokens=256, max_prompt_length=512)
    session = server.endpoint.open_session()
    base_url = server.base_url(session)          # the agent's openai.OpenAI(base_url=..., api_key="anything")
    ...                                          # the agent calls it: chat/completions, completions, models
    samples, completion, stats = rollout_of(session)   # training rows (Samples, as the tool loop's), its messages

Files: requests.py (OpenAI's request bodies, validated with the SDK's types; the error shape), chat.py (the chat
template's side: prompt and continuation ids, replies parsed by the response template), session.py (the recording
and its rows), batcher.py (concurrent requests into one engine call), endpoint.py (one call served within the run's
limits), responses.py (the SDK's response types, streamed chunks), server.py (HTTP on 127.0.0.1).
docs/agents.md says what is wired into runs and what is not yet.
"""
from __future__ import annotations

from trainer.agents.batcher import Batcher
from trainer.agents.endpoint import Endpoint
from trainer.agents.server import AgentServer
from trainer.agents.session import Session

__all__ = ["AgentServer", "Batcher", "Endpoint", "Session", "rollout_of", "serve"]


def serve(engine, tokenizer, *, model: str, max_new_tokens: int, max_prompt_length: int,
          max_calls: int | None = None, temperature: float = 1.0, top_p: float = 1.0, version=lambda: 0,
          window_s: float = 0.1, port: int = 0, greedy: bool = False) -> AgentServer:
    """An endpoint over `engine` (its own batching thread) serving on 127.0.0.1 (`port` 0: a free one). greedy:
    argmax decoding instead of temperature/top_p (an evaluation of the agent, as the demo's before/after)."""
    batcher = Batcher(engine, version=version, window_s=window_s, greedy=greedy)
    ep = Endpoint(batcher, tokenizer, model=model, max_new_tokens=max_new_tokens,
                  max_prompt_length=max_prompt_length, stop_ids=engine.eos_ids, max_calls=max_calls,
                  temperature=temperature, top_p=top_p)
    batcher.expected = lambda: len(ep.sessions)  # every open session waiting: no one else can come
    batcher.coming = ep.coming  # agents started, first call not yet made: worth waiting for
    return AgentServer(ep, port=port)


def rollout_of(session: Session) -> tuple[list, list[dict], dict]:
    """A finished session as the tool loop gives a rollout: its training rows (one Sample per segment: prompt ids,
    completion ids, logprobs, truncated, loss_mask on sampled tokens only), the conversation after its first
    request's messages (TRL's conversational completion), and its statistics (calls, segments, policy versions)."""
    return session.rows(), session.completion_messages(), session.stats()
