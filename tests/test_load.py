"""Load: 16 concurrent uploaders x 100 uploads and 4 concurrent getters against one real ref server.

A small --max-queue makes 503s really happen (the getters also start late, so both queues fill);
RefClient retries every one of them. Nothing lost, nothing duplicated, and the server's resident
memory stays bounded by its queue caps (sampled with psutil during the run).
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import psutil
import pytest
from conftest import start_ref_server
from test_ref_server import make_batch

from common.wire.client import RefClient
from common.wire.protocol import encode_rollout

pytestmark = pytest.mark.slow

UPLOADERS, PER_UPLOADER, GETTERS = 16, 100, 4
MAX_QUEUE, MAX_OUTPUT_QUEUE, THREADS = 8, 64, 8
PAD = 60_000  # metadata bytes per message: big messages (cheap to score) make an unbounded queue visible in RSS
GETTERS_START_AFTER = 2.0  # seconds: both queues fill and producers meet 503s


class CountingClient(RefClient):
    """RefClient that counts every HTTP answer it gets (status -> n)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.statuses: Counter = Counter()
        self.count_lock = threading.Lock()

    def _session(self):
        s = super()._session()
        if not getattr(s, "_counted", False):
            def hook(r, *args, **kwargs):
                with self.count_lock:
                    self.statuses[(r.request.method, r.status_code)] += 1
            s.hooks["response"].append(hook)
            s._counted = True
        return s


def batch(p: int, i: int):
    return make_batch([6, 5], [3, 4], L=10, seed=p * 1000 + i, producer_id=f"load{p}",
                      extra={"seq": i, "pad": "x" * PAD})


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.proc, self.every = psutil.Process(pid), every
        self.peak = self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
                self.samples += 1
            except psutil.Error:
                return
            time.sleep(self.every)


def test_load_nothing_lost_nothing_duplicated_memory_bounded(tiny_model_dir):
    total = UPLOADERS * PER_UPLOADER
    with start_ref_server(tiny_model_dir, "--max-queue", str(MAX_QUEUE), "--max-output-queue", str(MAX_OUTPUT_QUEUE),
                          "--threads", str(THREADS), "--retry-after", "1", "--device", "cpu",
                          "--drain-timeout", "0") as srv:
        server = psutil.Process(srv.proc.pid)
        msg_bytes = len(encode_rollout(batch(0, 0)))
        # Warm-up: one full round at the caps (the largest merged forward), so the baseline holds the model,
        # torch's workspace and the allocator's arenas. Then drain.
        with RefClient(srv.url, timeout=30) as warm:
            for i in range(MAX_QUEUE + MAX_OUTPUT_QUEUE):
                warm.upload(batch(99, i))
            while warm.get(timeout=2.0) is not None:
                pass
            before = warm.stats()
        baseline = server.memory_info().rss
        sampler = RssSampler(server.pid)
        sampler.start()

        up = CountingClient(srv.url, timeout=60, max_retries=5, backoff=0.2)
        down = CountingClient(srv.url, timeout=60, max_retries=5, backoff=0.2)
        sent: list[str] = []
        received: list[tuple[str, str, int]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        done = threading.Event()

        def produce(p: int) -> None:
            try:
                for i in range(PER_UPLOADER):
                    b = batch(p, i)
                    assert up.upload(b) == b.batch_id
                    with lock:
                        sent.append(b.batch_id)
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)

        def consume() -> None:
            try:
                time.sleep(GETTERS_START_AFTER)
                deadline = time.monotonic() + 240
                while not done.is_set() and time.monotonic() < deadline:
                    s = down.get(timeout=1.0)
                    if s is None:
                        continue
                    assert s.ref_logps.shape == (2, 4) and len(s.extra["pad"]) == PAD
                    with lock:
                        received.append((s.batch_id, s.producer_id, s.extra["seq"]))
                        if len(received) >= total:
                            done.set()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                done.set()

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(UPLOADERS)]
        threads += [threading.Thread(target=consume) for _ in range(GETTERS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        seconds = time.monotonic() - t0
        sampler.halt.set()
        sampler.join(5)
        stats = up.stats()
        up.close()
        down.close()

    assert not errors, errors[:3]
    ids = [r[0] for r in received]
    dup = len(ids) - len(set(ids))
    lost = len(set(sent) - set(ids))
    up_st = Counter({k[1]: v for k, v in up.statuses.items() if k[0] == "POST"})
    get_st = Counter({k[1]: v for k, v in down.statuses.items() if k[0] == "GET"})
    queue_full = stats["uploads_rejected"].get("queue_full", 0) - before["uploads_rejected"].get("queue_full", 0)
    for k in ("uploads_accepted", "batches_scored", "batches_served"):
        stats[k] -= before[k]
    queued = (MAX_QUEUE + MAX_OUTPUT_QUEUE) * msg_bytes
    # What the caps allow: each queued batch as its request body, its decoded form and its scored message
    # (3 copies), plus the waitress threads' request buffers, plus allocator / fragmentation slack.
    bound = baseline + 3 * queued + THREADS * 2 * msg_bytes + (32 << 20)
    unbounded = total * msg_bytes  # what the server would hold if it took everything while the getters slept
    peak_extra = sampler.peak - baseline
    print(f"\nload: {UPLOADERS} uploaders x {PER_UPLOADER} uploads ({msg_bytes / 1024:.0f} KiB each) + {GETTERS} "
          f"getters in {seconds:.1f} s")
    print(f"  requests tried: {sum(up_st.values())} uploads, {sum(get_st.values())} gets; upload statuses "
          f"{dict(up_st)}; get statuses {dict(get_st)}")
    print(f"  server: accepted {stats['uploads_accepted']}, rejected {stats['uploads_rejected']}, scored "
          f"{stats['batches_scored']}, served {stats['batches_served']}, forwards {stats['forwards']} "
          f"(scoring busy {stats['scoring_busy_s']:.1f} s)")
    print(f"  sent {len(sent)}, received {len(ids)}, lost {lost}, duplicated {dup}")
    print(f"  server RSS: baseline {baseline / 2**20:.0f} MiB, peak {sampler.peak / 2**20:.0f} MiB "
          f"(+{peak_extra / 2**20:.1f} MiB, {sampler.samples} samples); bound {bound / 2**20:.0f} MiB; "
          f"holding all {total} messages would be +{unbounded / 2**20:.0f} MiB")

    assert len(sent) == total and len(ids) == total
    assert lost == 0 and dup == 0 and set(ids) == set(sent)
    for p in range(UPLOADERS):  # FIFO per producer across the getters' union: each seq exactly once
        assert sorted(seq for _, pid, seq in received if pid == f"load{p}") == list(range(PER_UPLOADER))
    assert up_st[202] == total and stats["uploads_accepted"] == total  # no upload accepted twice
    assert up_st[503] > 0 and up_st[503] == queue_full  # 503s happened, and the client retried every one
    assert set(up_st) <= {202, 503} and set(get_st) <= {200, 204}
    assert stats["batches_scored"] == total and stats["batches_served"] == total
    assert sampler.samples > 50
    assert sampler.peak < bound, f"peak RSS {sampler.peak / 2**20:.0f} MiB over the bound {bound / 2**20:.0f} MiB"
    assert bound - baseline < unbounded  # the bound is tight enough to catch an unbounded queue
