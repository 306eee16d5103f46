"""Who is up, as the ref server's GET /status says (issue 42): workers count as started once they send a heartbeat
that is not a "waiting ..." one (trainer/worker.py heartbeats "waiting for ..." until it builds its engine, then its
round-by-round state). Ranks: trainer/worker.py ready_ranks."""
from __future__ import annotations

import logging
import time

from common.wire.client import RefServerError

log = logging.getLogger("trainer")


def started_workers(status: dict, fresh_s: float) -> list[str]:
    """The workers whose engine is up: a recent heartbeat, not a waiting one, not done."""
    return sorted(r["id"] for r in status.get("participants", []) if r.get("role") == "worker"
                  and r.get("last_heartbeat_ago_s") is not None and r["last_heartbeat_ago_s"] <= fresh_s
                  and not str(r.get("state", "")).startswith("waiting") and r.get("state") != "done")


class WorkersStarting:
    """A rank's view of the workers on its GPU that are still starting (cfg.gen_wait_for_workers): it does not
    generate for itself meanwhile (its allocations would break their vLLM memory profiling). Polls /status at most
    every `poll` seconds; once all are up, or past cfg.wait_for_ranks_timeout (said once), it stops asking."""

    def __init__(self, cfg, client, poll: float = 2.0):
        self.names, self.client, self.poll = sorted(cfg.gen_wait_for_workers), client, poll
        self.fresh_s, self.timeout = 2 * cfg.heartbeat_s + 5, cfg.wait_for_ranks_timeout
        self.t0, self.asked_at, self.done = time.monotonic(), 0.0, not self.names

    def still_starting(self) -> bool:
        if self.done or time.monotonic() - self.asked_at < self.poll:
            return not self.done
        self.asked_at = time.monotonic()
        try:
            up = started_workers(self.client.status(timeout=10), self.fresh_s)
        except RefServerError as e:  # a hiccup: ask again next time
            log.info("GET /status failed while waiting for workers to start: %s", e)
            return True
        missing = [n for n in self.names if n not in up]
        if not missing:
            log.info("worker(s) %s up after %.0f s: this rank may generate for itself again", ", ".join(self.names),
                     time.monotonic() - self.t0)
            self.done = True
        elif time.monotonic() - self.t0 > self.timeout:
            log.warning("worker(s) %s still not up after %.0f s (wait_for_ranks_timeout): this rank generates for "
                        "itself now", ", ".join(missing), self.timeout)
            self.done = True
        return not self.done
