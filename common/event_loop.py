"""The process's one event loop for async user code: `async def` rewards, async tools, an environment's async
`get_reward` (and agents), as TRL runs them on one persistent loop (GRPOTrainer's "GRPOTrainer-AsyncLoop":
trl.trainer.utils.start_event_loop_in_daemon, a loop run forever on a daemon thread).

Why one loop: a reward holding a module-level `httpx.AsyncClient` / `AsyncOpenAI` (the usual LLM-judge pattern),
an `asyncio.Queue` or a connection pool is bound to the loop it first ran on; `asyncio.run` per call gave every call
a new loop, and the second call failed ("Event loop is closed", "attached to a different loop").

Not TRL's own helper: importing trl.trainer.utils costs ~8 s (it imports TRL's trainers), paid again by every
reward and tool worker process; the loop itself is these few lines. A worker killed on a timeout takes its loop
with it; the next worker starts a new one.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

_lock = threading.Lock()
_state: dict = {"loop": None, "thread": None, "pid": None}


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, started on a daemon thread at first use (again in a forked child: threads do not
    survive a fork)."""
    with _lock:
        lp, thread = _state["loop"], _state["thread"]
        if lp is None or _state["pid"] != os.getpid() or not thread.is_alive():
            lp = asyncio.new_event_loop()
            ready = threading.Event()

            def run_forever():
                asyncio.set_event_loop(lp)
                ready.set()
                lp.run_forever()

            thread = threading.Thread(target=run_forever, name="grpo-async-loop", daemon=True)
            thread.start()
            ready.wait()
            _state.update(loop=lp, thread=thread, pid=os.getpid())
        return lp


def run(coro, timeout: float | None = None):
    """Run a coroutine on the process's loop and return its value (or raise its exception), from any thread but
    the loop's own. Whatever interrupts the wait (a timeout, an exception a signal handler raises, Ctrl-C)
    cancels the coroutine and is raised."""
    lp = loop()
    if threading.current_thread() is _state["thread"]:
        coro.close()
        raise RuntimeError("event_loop.run() called from the event loop's own thread: await the coroutine instead")
    fut = asyncio.run_coroutine_threadsafe(coro, lp)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:  # in slices: a process-wide signal (SIGXCPU) may land on the loop's thread, and the main
            # thread runs its Python handler only once it wakes; a done future returns at once
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            try:
                return fut.result(max(left, 0.0))
            except TimeoutError:
                if fut.done() or (deadline is not None and time.monotonic() >= deadline):
                    raise  # the coroutine's own TimeoutError, or ours
    except BaseException:
        fut.cancel()  # the task is cancelled at its next await
        raise


def responsive(within: float = 1.0) -> bool:
    """Whether the loop runs a no-op within `within` seconds: False when a coroutine holds it without awaiting
    (a CPU-bound loop in an `async def`), which cancelling cannot stop; only ending the process frees it."""
    fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop())
    try:
        fut.result(within)
        return True
    except TimeoutError:
        fut.cancel()
        return False
