"""common/event_loop.py: the process's one persistent event loop for async user code (issue 60), as TRL runs async
rewards, tools and get_reward on one daemon-thread loop: an object bound to the loop at one call works at the next,
from any thread; a timeout cancels the coroutine; the coroutine's own errors come back as they are."""
from __future__ import annotations

import asyncio
import threading

import pytest

from common import event_loop

QUEUE = asyncio.Queue()  # bound to the loop of the first wait on it


async def echo_later(x):
    asyncio.get_running_loop().call_later(0.005, QUEUE.put_nowait, x)
    return await QUEUE.get()


def test_a_loop_bound_object_works_across_calls_and_threads():
    assert [event_loop.run(echo_later(i)) for i in range(3)] == [0, 1, 2]
    got = []
    threads = [threading.Thread(target=lambda: got.append(event_loop.run(echo_later("t")))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["t"] * 3 and event_loop.loop() is event_loop.loop()
    with pytest.raises(RuntimeError, match="different event loop"):  # what asyncio.run per call gave
        asyncio.run(echo_later("new loop"))


def test_a_timeout_cancels_the_coroutine_and_its_own_errors_come_back():
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        event_loop.run(slow(), timeout=0.2)
    assert cancelled.wait(2.0)

    async def own_timeout():
        raise TimeoutError("the judge's own")

    with pytest.raises(TimeoutError, match="the judge's own"):  # done: raised at once, not waited on forever
        event_loop.run(own_timeout())

    async def nested():
        return event_loop.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="loop's own thread"):
        event_loop.run(nested())
    assert event_loop.responsive()
