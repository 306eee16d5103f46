"""The scoring side of the ref server: bounded FIFO queues, a worker thread, and counters.

Uploads go into a bounded input queue. One worker thread takes as many queued batches as
fit `score_token_budget` (and the free room in the output queue), scores them in one
forward with the frozen model, splits the result back per batch and appends the encoded
ScoredBatch messages to a bounded output queue that GET /get pops from. When the output
queue is full the worker waits, the input queue fills and uploads get 503: backpressure
all the way to the producers, never a silent drop and never unbounded growth.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.logprobs import sequence_logprobs
from common.pack_choice import choose_packed
from common.packing import forward_tokens, padding_share, row_groups
from common.wire.protocol import RolloutBatch, ScoredBatch, encode_scored

log = logging.getLogger("ref_server")


class QueueFull(Exception):
    """The input queue is at capacity (answer 503)."""


class Stopping(Exception):
    """The server is shutting down and takes no more uploads (answer 503)."""


# ---------------------------------------------------------------------------------------
class ServerMetrics:
    """Plain counters for /stats mirrored into a private Prometheus registry for /metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.time()
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.scored = self.served = self.errors = 0
        self.tokens_scored = 0         # completion tokens whose logprob was computed
        self.tokens_forward = 0        # real (unpadded) tokens through the model
        self.tokens_computed = 0       # tokens the forwards computed: real + padding (equal when padding-free)
        self.last_padding_share = 0.0  # padded / computed tokens of the last scoring forward(s)
        self.padding_free = False      # set by the Scorer: packed forwards (common/packing.py) or padded ones
        self.forwards = 0
        self.ref_skipped = 0           # batches passed through without a reference forward (needs_ref false)
        self.busy_s = 0.0
        self.last_latency_s = 0.0
        self.registry = r = CollectorRegistry()  # private: several servers may live in one process (tests)
        self.p_accepted = Counter("grpo_ref_uploads_accepted", "Uploads accepted (202).", registry=r)
        self.p_rejected = Counter("grpo_ref_uploads_rejected", "Uploads refused, by reason.", ["reason"], registry=r)
        self.p_scored = Counter("grpo_ref_batches_scored", "Batches scored.", registry=r)
        self.p_served = Counter("grpo_ref_batches_served", "Scored batches handed out by /get.", registry=r)
        self.p_skipped = Counter("grpo_ref_batches_ref_skipped", "Batches that needed no reference logprobs "
                                 "(beta = 0): queued and served without a forward.", registry=r)
        self.p_errors = Counter("grpo_ref_scoring_errors", "Batches whose scoring failed.", registry=r)
        self.p_tokens = Counter("grpo_ref_tokens_scored", "Completion tokens scored.", registry=r)
        self.p_fwd_tokens = Counter("grpo_ref_forward_tokens", "Real tokens through the model.", registry=r)
        self.p_latency = Histogram("grpo_ref_scoring_seconds", "Seconds per scoring forward.", registry=r,
                                   buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.p_tps = Gauge("grpo_ref_scoring_tokens_per_second", "Forward tokens / busy second (cumulative).",
                           registry=r)
        self.p_tps.set_function(self.tokens_per_s)
        self.p_padding = Gauge("grpo_ref_padding_share", "Padded tokens / computed tokens (cumulative).",
                               registry=r)
        self.p_padding.set_function(self.padding_share)
        self.p_depth = Gauge("grpo_ref_queue_depth", "Batches waiting, by queue.", ["queue"], registry=r)

    def tokens_per_s(self) -> float:
        return self.tokens_forward / self.busy_s if self.busy_s > 0 else 0.0

    def padding_share(self) -> float:
        return padding_share(self.tokens_computed, self.tokens_forward)

    def on_accept(self) -> None:
        with self.lock:
            self.accepted += 1
        self.p_accepted.inc()

    def on_reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.p_rejected.labels(reason=reason).inc()

    def on_served(self) -> None:
        with self.lock:
            self.served += 1
        self.p_served.inc()

    def on_scored(self, batches: int, tokens: int, fwd_tokens: int, seconds: float, computed: int | None = None
                  ) -> None:
        computed = fwd_tokens if computed is None else computed
        with self.lock:
            self.scored += batches
            self.tokens_scored += tokens
            self.tokens_forward += fwd_tokens
            self.tokens_computed += computed
            self.last_padding_share = padding_share(computed, fwd_tokens)
            self.forwards += 1
            self.busy_s += seconds
            self.last_latency_s = seconds
        self.p_scored.inc(batches)
        self.p_tokens.inc(tokens)
        self.p_fwd_tokens.inc(fwd_tokens)
        self.p_latency.observe(seconds)

    def on_ref_skipped(self, batches: int) -> None:
        with self.lock:
            self.scored += batches
            self.ref_skipped += batches
        self.p_scored.inc(batches)
        self.p_skipped.inc(batches)

    def on_error(self, batches: int) -> None:
        with self.lock:
            self.errors += batches
        self.p_errors.inc(batches)

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "uptime_s": round(time.time() - self.started, 3),
                "uploads_accepted": self.accepted, "uploads_rejected": dict(self.rejected),
                "batches_scored": self.scored, "batches_served": self.served, "scoring_errors": self.errors,
                "tokens_scored": self.tokens_scored, "forward_tokens": self.tokens_forward,
                "forwards": self.forwards, "batches_ref_skipped": self.ref_skipped,
                "scoring_busy_s": round(self.busy_s, 4),
                "scoring_tokens_per_s": round(self.tokens_per_s(), 2),
                "last_scoring_latency_s": round(self.last_latency_s, 4),
                "mean_scoring_latency_s": round(self.busy_s / self.forwards, 4) if self.forwards else 0.0,
                "computed_tokens": self.tokens_computed, "padding_free": self.padding_free,
                "padding_share": round(self.padding_share(), 4),
                "last_padding_share": round(self.last_padding_share, 4),
            }


# ---------------------------------------------------------------------------------------
@dataclass
class _Scored:
    batch_id: str
    body: bytes
    queued_at: float = 0.0  # when it entered the output queue (GET /status shows the oldest's age)


def score_key(b: RolloutBatch) -> tuple[bool, float]:
    """Batches scored in one forward must agree on it: whether they need ref logprobs (needs_ref, default true)
    and the temperature of those logprobs (logp_temperature, default 1 = raw)."""
    return b.needs_ref, float(b.logp_temperature)


def _padded_tokens(group: list[RolloutBatch]) -> int:
    return sum(b.num_rows for b in group) * max(int(b.input_ids.shape[1]) for b in group)


class Scorer:
    """Bounded input queue -> worker thread (frozen model) -> bounded output queue."""

    def __init__(self, model: torch.nn.Module, metrics: ServerMetrics, max_queue: int, max_output_queue: int,
                 score_token_budget: int, chunk_tokens: int, padding_free: bool | str = False) -> None:
        self.model = model.eval()
        self.metrics = metrics
        self.setting = padding_free  # true / false / auto: chosen per scoring call (common/pack_choice.py)
        metrics.padding_free = str(padding_free).lower() == "true"
        self.max_queue, self.max_output_queue = max_queue, max_output_queue
        self.budget, self.chunk_tokens = score_token_budget, chunk_tokens
        self.inq: deque[RolloutBatch] = deque()
        self.outq: deque[_Scored] = deque()
        lock = threading.Lock()  # one lock for both queues: every operation under it is O(1)
        self.work = threading.Condition(lock)    # input arrived / output room freed / stopping
        self.ready = threading.Condition(lock)   # output arrived / stopping
        self.stopping = False
        self.busy = False
        self.warned_full = False
        self.thread = threading.Thread(target=self._run, name="scorer", daemon=True)
        metrics.p_depth.labels(queue="input").set_function(lambda: len(self.inq))
        metrics.p_depth.labels(queue="output").set_function(lambda: len(self.outq))

    def start(self) -> Scorer:
        self.thread.start()
        return self

    # -- called from HTTP threads ----------------------------------------------------------
    def depths(self) -> dict:
        with self.work:
            return {"input": len(self.inq), "output": len(self.outq), "scoring": self.busy}

    def ages(self) -> dict:
        """Seconds the oldest item of each queue has waited (None when empty)."""
        now = time.time()
        with self.work:
            first_in = self.inq[0] if self.inq else None
            first_out = self.outq[0] if self.outq else None
        return {"input": None if first_in is None else round(now - getattr(first_in, "queued_at", now), 1),
                "output": None if first_out is None else round(now - first_out.queued_at, 1)}

    def full(self) -> bool:
        with self.work:
            return len(self.inq) >= self.max_queue

    def submit(self, rb: RolloutBatch) -> int:
        """Queue a batch; returns the input depth after it. Raises QueueFull / Stopping."""
        with self.work:
            if self.stopping:
                raise Stopping()
            if len(self.inq) >= self.max_queue:
                if not self.warned_full:  # once per process: after that /stats and /metrics count it
                    self.warned_full = True
                    log.warning("input queue full (%d batches): answering 503 until consumers catch up",
                                self.max_queue)
                raise QueueFull()
            rb.queued_at = time.time()  # type: ignore[attr-defined]  # for the queue age in GET /status
            self.inq.append(rb)
            self.work.notify()
            return len(self.inq)

    def take(self, wait: float = 0.0) -> bytes | None:
        """Pop the oldest scored message, waiting up to `wait` seconds; None if nothing came."""
        deadline = time.monotonic() + wait
        with self.work:
            while not self.outq:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping:
                    return None
                self.ready.wait(left)
            item = self.outq.popleft()
            self.work.notify()  # room in the output queue: the worker may go on
        self.metrics.on_served()
        return item.body

    def stop(self, timeout: float = 600.0) -> None:
        """Refuse new uploads, let the worker finish the forward in progress, then return."""
        with self.work:
            self.stopping = True
            dropped = len(self.inq)
            self.work.notify_all()
            self.ready.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if dropped:
            log.warning("stopping: %d queued upload(s) not scored", dropped)

    # -- worker thread ----------------------------------------------------------------------
    def _next_group(self) -> list[RolloutBatch] | None:
        with self.work:
            while not self.stopping and (not self.inq or len(self.outq) >= self.max_output_queue):
                self.work.wait()
            if self.stopping:
                return None
            room = self.max_output_queue - len(self.outq)
            group = [self.inq.popleft()]
            while (self.inq and len(group) < room and score_key(self.inq[0]) == score_key(group[0])
                   and _padded_tokens(group + [self.inq[0]]) <= self.budget):
                group.append(self.inq.popleft())
            self.busy = True
            return group

    def _run(self) -> None:
        with torch.inference_mode():  # thread-local: must be entered in the worker thread itself
            while True:
                group = self._next_group()
                if group is None:
                    return
                out = self._score_group(group)
                with self.work:
                    self.outq.extend(out)
                    self.busy = False
                    self.ready.notify_all()

    def _score_group(self, group: list[RolloutBatch]) -> list[_Scored]:
        try:
            return self._score(group)
        except Exception as e:  # noqa: BLE001 - a bad batch or an OOM must not kill the worker
            if len(group) == 1:
                log.exception("scoring batch %s failed: %s", group[0].batch_id, e)
                self.metrics.on_error(1)
                return []
            # A merged forward may fail where single ones fit (memory): say so, then retry one at a time.
            log.warning("scoring %d merged batches failed (%s); scoring them one by one", len(group), e)
            return [s for b in group for s in self._score_group([b])]

    def _score(self, group: list[RolloutBatch]) -> list[_Scored]:
        needs_ref, temperature = score_key(group[0])
        if not needs_ref:  # beta = 0: the server is still the queue, but no forward is spent on it
            out = [_Scored(b.batch_id, encode_scored(ScoredBatch.from_rollout(b, None)), time.time()) for b in group]
            self.metrics.on_ref_skipped(len(group))
            return out
        t0 = time.perf_counter()
        L = max(int(b.input_ids.shape[1]) for b in group)
        # Right-pad every row to the longest; masks come from the lengths, so the pad id is irrelevant.
        ids = torch.cat([torch.nn.functional.pad(b.input_ids.long(), (0, L - b.input_ids.shape[1])) for b in group])
        pl = torch.cat([b.prompt_lens.long() for b in group])
        cl = torch.cat([b.completion_lens.long() for b in group])
        logps, computed = self.score_rows(ids, pl, cl, temperature)
        out, row = [], 0
        for b in group:
            ref = logps[row:row + b.num_rows, :b.max_completion_len].contiguous()
            row += b.num_rows
            out.append(_Scored(b.batch_id, encode_scored(ScoredBatch.from_rollout(b, ref)), time.time()))
        self.metrics.on_scored(len(group), int(cl.sum()), int((pl + cl).sum()), time.perf_counter() - t0, computed)
        return out

    def score_rows(self, ids: torch.Tensor, pl: torch.Tensor, cl: torch.Tensor, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, int]:
        """(B, T) reference logprobs of right-padded rows and the tokens the forwards computed. Forwards of at most
        `budget` computed tokens (one huge upload must not blow up memory): packed rows (padding_free), or rows
        grouped by length and trimmed to their own longest (common/packing.py row_groups)."""
        logps = torch.zeros(ids.shape[0], int(cl.max()), dtype=torch.float32)
        computed = 0
        packed = choose_packed(self.setting, self.model, pl, cl, max(1, self.budget // int((pl + cl).max())),
                               self.budget)
        self.metrics.padding_free = packed  # the last call's choice
        for rows in row_groups(pl + cl, self.budget, packed):
            p, c = pl[rows], cl[rows]
            lp, _ = sequence_logprobs(self.model, ids[rows, :int((p + c).max())], p, c, chunk_tokens=self.chunk_tokens,
                                      temperature=temperature, padding_free=packed)
            logps[rows, :lp.shape[1]] = lp.float().cpu()
            computed += forward_tokens(p, c, packed)[0]
        return logps, computed
