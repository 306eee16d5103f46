"""A persistent event loop on a daemon thread for `async def` agents (as TRL runs async rewards on one loop: a
client an agent keeps at module level, an `AsyncOpenAI`, stays bound to the loop it first ran on).

Private to trainer/agents/ until the process-wide loop of issue 47 (common/event_loop.py, being added in parallel)
lands; then `loop()` here becomes that module's.
"""
from __future__ import annotations

import asyncio
import os
import threading

_lock = threading.Lock()
_state: dict = {"loop": None, "thread": None, "pid": None}


def loop() -> asyncio.AbstractEventLoop:
    """The loop, started at first use (again in a forked child: threads do not survive a fork)."""
    with _lock:
        lp, thread = _state["loop"], _state["thread"]
        if lp is None or _state["pid"] != os.getpid() or not thread.is_alive():
            lp = asyncio.new_event_loop()
            ready = threading.Event()

            def run_forever():
                asyncio.set_event_loop(lp)
                ready.set()
                lp.run_forever()

            thread = threading.Thread(target=run_forever, name="agents-async-loop", daemon=True)
            thread.start()
            ready.wait()
            _state.update(loop=lp, thread=thread, pid=os.getpid())
        return lp
