"""A round of user agents (trainer/agents/runner.py) against the endpoint, with the real openai SDK: the contract's
keyword arguments, sync and `async def` agents, max_concurrency, and an agent that raises, outruns its timeout,
never calls the endpoint or returns something else than a float, each its rollout's reward None, none waited for."""
from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest

from tests.agent_doubles import ScriptedEngine
from tests.tool_doubles import spelled
from trainer.agents import serve
from trainer.agents.runner import run_agents

MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from common.tiny_model import build_tokenizer
    return build_tokenizer()


@pytest.fixture
def server(tok):
    made = []

    def make(turns, delay=0.0):
        srv = serve(ScriptedEngine(tok, turns, delay=delay), tok, model="policy", max_new_tokens=200,
                    max_prompt_length=400)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


ROWS = [{"prompt": "What is 2 * 3?", "answer": "6"}, {"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}]


def test_a_sync_agent_gets_the_contracts_arguments_and_its_float_is_its_verdict(tok, server):
    srv = server([spelled(tok, "6") + [tok.eos_token_id]])
    seen = []

    def solve(base_url, model, prompt, answer):
        seen.append((base_url, model, prompt, answer))
        client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0)
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        r = client.chat.completions.create(model=model, messages=msgs)
        msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model=model, messages=msgs)
        return 1.0 if r.choices[0].message.content == answer else 0

    runs = run_agents(srv, solve, ROWS, timeout=30)
    assert sorted(map(str, [(m, p, a) for _, m, p, a in seen])) == sorted(map(str, [
        ("policy", r["prompt"], r["answer"]) for r in ROWS]))  # two threads: in either order
    assert {u for u, *_ in seen} == {srv.base_url(r.session) for r in runs}  # each rollout its own session
    assert [r.value for r in runs] == [1.0, 0.0] and [r.error for r in runs] == [None, None]
    assert all(r.session.stats()["turns"] == 2 and r.session.stats()["segments"] == 1 for r in runs)
    assert srv.endpoint.sessions == {}  # closed after the round


def test_async_agents_run_on_one_loop_at_most_max_concurrency_at_once(tok, server):
    srv = server([spelled(tok, "<think> x </think>\n") + tok(CALL, add_special_tokens=False)["input_ids"]
                  + [tok.eos_token_id]], delay=0.05)
    live, peak, loops = [0], [0], set()
    client_of = {}

    async def solve(base_url, model, prompt, **columns):
        loops.add(id(asyncio.get_running_loop()))
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        try:
            client = client_of.setdefault(base_url, openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0))
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                     tools=[MUL], tool_choice="auto")
            return 0.5 if r.choices[0].finish_reason == "tool_calls" else 0.0
        finally:
            live[0] -= 1

    runs = run_agents(srv, solve, [{"prompt": f"q{i}"} for i in range(6)], timeout=30, max_concurrency=2)
    assert [r.value for r in runs] == [0.5] * 6 and peak[0] == 2 and len(loops) == 1


def test_failing_agents_have_no_reward_and_nothing_waits_for_them(tok, server):
    srv = server([spelled(tok, "a") + [tok.eos_token_id]])
    late = {}

    def call(base_url, model):
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])

    def solve(base_url, model, prompt):
        if prompt == "raise":
            raise ValueError("boom")
        if prompt == "slow":
            call(base_url, model)
            time.sleep(5.5)  # past the timeout by more than a loaded machine's slowest call
            try:
                call(base_url, model)
            except openai.NotFoundError as e:  # its session was closed at the timeout
                late["error"] = e.status_code
            return 1.0
        if prompt == "silent":
            return 1.0
        if prompt == "text":
            call(base_url, model)
            return "yes"
        call(base_url, model)
        return None

    t0 = time.monotonic()
    runs = run_agents(srv, solve, [{"prompt": p} for p in ("raise", "slow", "silent", "text", "fine")],
                      timeout=4, max_concurrency=2)  # 4 s: room for a loaded CI machine's calls (0.5 s was not)
    assert time.monotonic() - t0 < 5.3  # the slow one (>= 5.5 s) was not waited for
    errors = [r.error for r in runs]
    assert errors[0] == "raised ValueError: boom" and errors[1] == "timed out after 4 s (agent_timeout)"
    assert errors[2] == "never called the endpoint" and errors[3] == "returned str, not a float or None"
    assert errors[4] is None and [r.value for r in runs] == [None] * 5
    deadline = time.monotonic() + 5
    while "error" not in late and time.monotonic() < deadline:
        time.sleep(0.05)
    assert late == {"error": 404} and runs[1].value is None


def test_an_async_agent_past_its_timeout_is_cancelled(tok, server):
    srv = server([spelled(tok, "a") + [tok.eos_token_id]])
    cancelled = threading.Event()

    async def solve(base_url, model, prompt):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    t0 = time.monotonic()
    (run,) = run_agents(srv, solve, [{"prompt": "p"}], timeout=0.3)
    assert run.error == "timed out after 0.3 s (agent_timeout)" and time.monotonic() - t0 < 3
    assert cancelled.wait(2)


def test_a_rounds_first_calls_go_in_one_engine_call_however_spread_their_starts(tok, server):
    """Agents that start slowly (here 0.25 s apart, as a loaded machine spreads them) are waited for: the batcher
    knows which started agents have not called yet, so a round of single-call agents is one engine call."""
    srv = server([spelled(tok, "a") + [tok.eos_token_id]])
    order = iter(range(100))
    lock = threading.Lock()

    def solve(base_url, model, prompt):
        with lock:
            k = next(order)
        time.sleep(0.25 * k)  # staggered past the 0.1 s window
        openai.OpenAI(base_url=base_url, api_key="k", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}])
        return 1.0

    runs = run_agents(srv, solve, [{"prompt": f"q{i}"} for i in range(5)], timeout=30)
    assert [r.value for r in runs] == [1.0] * 5 and srv.endpoint.batcher.engine_calls == 1
