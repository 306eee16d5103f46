"""A round of agents: the user's function called once per rollout against its own session of the endpoint.

    runs = run_agents(server, solve, rows, timeout=300, max_concurrency=16)
    for r in runs: r.session (its recorded calls), r.value (the agent's own float, or None), r.error (or None)

Each call gets `base_url` (its session's), `model` (the name served) and the row's keywords (`prompt` and the
example's other columns). An `async def` agent runs on a persistent event loop (common/event_loop.py), at
most `max_concurrency` at once, each bounded by `asyncio.wait_for(timeout)`; a sync one in its own daemon thread,
as many at once, and one past its `timeout` is left behind: its session is closed, so its next call gets a 404
and the SDK raises in it, and nothing waits for it. An agent that raises, outruns its timeout, never calls the
endpoint, or returns something other than None or a number has `error` set (its rollout's reward is None: TRL's
all-None semantics); an async agent that blocks the loop without awaiting cannot be cut by its timeout.

Called per generation round by trainer/agents/rollout.py (docs/agents.md).
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass

from common.event_loop import loop  # the process-wide loop async rewards and tools run on (issue 60)
from trainer.agents.session import Session
from trainer.tools.types import one_line


@dataclass
class AgentRun:
    session: Session
    value: float | None = None   # the agent's own verdict (a reward named after the function), or None
    error: str | None = None     # why the rollout has no reward: raised / timed out / never called / bad return
    seconds: float = 0.0


def _verdict(run: AgentRun, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        run.error = f"returned {type(value).__name__}, not a float or None"
    elif not run.session.calls:
        run.error = "never called the endpoint"
    else:
        run.value = None if value is None else float(value)


def _raised(e: BaseException) -> str:
    """One line: the exception, and its cause where the SDK wraps one ("Connection error." says nothing alone)."""
    cause = e.__cause__ or e.__context__
    why = f" (cause: {type(cause).__name__}: {cause})" if cause is not None and str(cause) != str(e) else ""
    return one_line(f"raised {type(e).__name__}: {e}{why}", 300)


def run_agents(server, agent, rows: list[dict], *, timeout: float, max_concurrency: int | None = None
               ) -> list[AgentRun]:
    """One AgentRun per row, in order; each session is closed when its agent is done (a later call: 404)."""
    ep = server.endpoint
    runs = [AgentRun(ep.open_session()) for _ in rows]
    kwargs = [{**row, "base_url": server.base_url(r.session), "model": ep.model} for r, row in zip(runs, rows)]
    limit = max(1, max_concurrency or len(rows) or 1)
    try:
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__):
            _run_async(agent, runs, kwargs, timeout, limit, ep)
        else:
            _run_sync(agent, runs, kwargs, timeout, limit, ep)
    finally:
        for r in runs:
            ep.close_session(r.session)
    return runs


def _run_async(agent, runs: list[AgentRun], kwargs: list[dict], timeout: float, limit: int, ep) -> None:
    async def one(run: AgentRun, kw: dict, gate: asyncio.Semaphore) -> None:
        async with gate:
            t0 = time.monotonic()
            run.session.started = True
            try:
                _verdict(run, await asyncio.wait_for(agent(**kw), timeout))
            except asyncio.TimeoutError:
                run.error = f"timed out after {timeout:g} s (agent_timeout)"
            except Exception as e:  # the agent's own failure: its rollout has no reward, the round goes on
                run.error = _raised(e)
            ep.close_session(run.session)  # done: the batcher no longer waits for it
            run.seconds = time.monotonic() - t0

    async def round_() -> None:
        gate = asyncio.Semaphore(limit)
        await asyncio.gather(*(one(r, kw, gate) for r, kw in zip(runs, kwargs)))

    waves = -(-len(runs) // limit)
    fut = asyncio.run_coroutine_threadsafe(round_(), loop())
    try:
        fut.result(timeout=waves * timeout + 30)  # each wait_for is bounded; this bounds a loop held by one agent
    except TimeoutError:
        fut.cancel()
        for r in runs:
            if r.value is None and r.error is None:
                r.error = "timed out: the agent held the event loop without awaiting"


def _run_sync(agent, runs: list[AgentRun], kwargs: list[dict], timeout: float, limit: int, ep) -> None:
    lock = threading.Lock()
    free = threading.Semaphore(limit)
    finished = [threading.Event() for _ in runs]
    released = [False] * len(runs)

    def release(i: int) -> None:
        with lock:
            if not released[i]:
                released[i] = True
                free.release()

    def one(i: int) -> None:
        t0 = time.monotonic()
        runs[i].session.started = True
        try:
            value = agent(**kwargs[i])
            if not finished[i].is_set():
                _verdict(runs[i], value)
        except Exception as e:  # the agent's own failure (a timed-out one's calls now get 404s): no reward
            if not finished[i].is_set():
                runs[i].error = _raised(e)
        ep.close_session(runs[i].session)  # done: the batcher no longer waits for it
        runs[i].seconds = time.monotonic() - t0
        finished[i].set()
        release(i)

    started: dict[int, float] = {}

    def expire() -> None:
        now = time.monotonic()
        for i, t0 in list(started.items()):
            if not finished[i].is_set() and now - t0 > timeout:
                runs[i].error = f"timed out after {timeout:g} s (agent_timeout)"
                ep.close_session(runs[i].session)  # its later calls: 404; nothing waits for it
                finished[i].set()
                release(i)

    for i in range(len(runs)):
        while not free.acquire(timeout=0.05):
            expire()
        started[i] = time.monotonic()
        threading.Thread(target=one, args=(i,), name=f"agent-{i}", daemon=True).start()
    while not all(f.is_set() for f in finished):
        expire()
        time.sleep(0.02)
