"""Requests that arrive together, served by one engine call: a small batching queue in front of a GenEngine.

    batcher = Batcher(engine, version=lambda: policy_version)
    sample, version = batcher.generate(context_ids, max_new_tokens)   # blocks this request's thread
    with batcher.lock: engine.load_weights(...)                         # never inside a call

One thread owns the engine. It takes the first waiting request, then every request that arrives within
`window_s` (0.1 s) of the last one (agents of a round start together, but each builds its client first: tens of ms
apart, more on a loaded machine), until as many wait as there are open sessions (`expected`: then no one else can
come) or the first has waited `max_wait_s` (2 s); while an agent of the round has started but not yet made its first
call (`coming`), it is waited for whatever the window (a loaded machine spreads a round's first calls over seconds).
Then one `generate(prompts, 1, max_new_tokens=[each one's budget])`: the HF engine batches them in one left-padded
`generate`, vLLM schedules them with its own continuous batching inside that call. Requests that arrive while the
engine is busy wait and go together into the next call. A failing engine call fails each of its requests with the
engine's error (the endpoint answers it), so no request waits forever on a dead engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from trainer.engines.base import GenEngine, Sample

log = logging.getLogger(__name__)


@dataclass
class _Job:
    context: list[int]
    limit: int
    done: threading.Event = field(default_factory=threading.Event)
    sample: Sample | None = None
    version: int = 0
    error: BaseException | None = None


class Batcher:
    def __init__(self, engine: GenEngine, version=lambda: 0, window_s: float = 0.1, max_rows: int = 512,
                 expected=lambda: 0, coming=lambda: 0, max_wait_s: float = 2.0, greedy: bool = False):
        self.greedy = greedy  # argmax decoding instead of the run's sampling (an evaluation's endpoint)
        self.engine, self.version, self.window_s, self.max_rows = engine, version, window_s, max_rows
        self.max_wait_s = max_wait_s  # the first request of a batch waits at most this long for the others
        self.coming = coming  # agents started that have not made their first call yet: they will come
        self.expected = expected  # how many requests could come at most (the open sessions): stop waiting there
        self.lock = threading.Lock()  # held for each engine call: a weight load takes it, so none lands inside one
        self.engine_calls = 0         # generate calls made, and the requests they served (batching, in metrics)
        self.requests = 0
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="agent-engine", daemon=True)
        self._thread.start()

    def generate(self, context: list[int], max_new_tokens: int) -> tuple[Sample, int]:
        """One completion of `context` (n=1) at the run's sampling (greedy: argmax), and the policy version that
        sampled it."""
        if not self._thread.is_alive():
            raise RuntimeError("the agent endpoint's engine thread has stopped")
        job = _Job(list(context), int(max_new_tokens))
        self._q.put(job)
        while not job.done.wait(0.5):  # the engine thread gone (close(), or it died): no request waits for it
            if not self._thread.is_alive():
                raise RuntimeError("the agent endpoint's engine thread has stopped")
        if job.error is not None:
            raise job.error
        return job.sample, job.version

    def _collect(self, first: _Job) -> list[_Job]:
        jobs, last = [first], time.monotonic()
        until = last + self.max_wait_s
        while len(jobs) < self.max_rows and len(jobs) < self.expected():
            now, coming = time.monotonic(), self.coming()
            if now >= until or (not coming and now - last >= self.window_s):
                break
            try:  # an agent still starting is waited for (polled), else the window since the last arrival
                nxt = self._q.get(timeout=min(0.01 if coming else self.window_s - (now - last), until - now))
            except queue.Empty:
                continue
            if nxt is None:  # close(): serve what was collected, then stop
                self._q.put(None)
                break
            jobs.append(nxt)
            last = time.monotonic()
        return jobs

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            jobs = self._collect(first)
            with self.lock:
                version = int(self.version())
                try:
                    out = self.engine.generate([j.context for j in jobs], 1, max_new_tokens=[j.limit for j in jobs],
                                               greedy=self.greedy)
                    if len(out) != len(jobs):
                        raise RuntimeError(f"the engine returned {len(out)} completions for {len(jobs)} requests")
                except Exception as e:  # any failure: every waiting request gets it, none hangs
                    log.error("agent endpoint: engine call for %d request(s) failed: %s: %s", len(jobs),
                              type(e).__name__, e)
                    out, error = [None] * len(jobs), e
                else:
                    error = None
                self.engine_calls += 1
                self.requests += len(jobs)
            for j, s in zip(jobs, out):
                j.sample, j.version, j.error = s, version, error
                j.done.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)
