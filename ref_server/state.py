"""The ref server's state: the model, the scorer and its queues, the relayed weights, the heartbeat table, and
the two views of it the app serves (GET /status, GET /health). ref_server/app.py builds it and routes to it.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

from ref_server.config import ServerConfig
from ref_server.scorer import Scorer, ServerMetrics
from ref_server.status import HeartbeatTable, by_host
from ref_server.weights import WeightStore
from ref_server.weights_limit import WeightsLimit


@dataclass
class ServerState:
    cfg: ServerConfig
    model: torch.nn.Module
    scorer: Scorer
    metrics: ServerMetrics
    token: str | None
    vocab_size: int
    max_seq_len: int
    long_polls: threading.BoundedSemaphore  # keeps waitress threads free for uploads
    weights_limit: WeightsLimit  # the largest PUT /weights: --max_weights_mb, or derived from the model
    weights: WeightStore = field(default_factory=WeightStore)  # the policy weights relayed to workers
    heartbeats: HeartbeatTable = field(default_factory=HeartbeatTable)  # who called in when (GET /status)
    stopping: bool = False
    placement: dict | None = None  # the run's placement plan (launch.sh), shown by GET /status

    def status(self, stall_warn: float) -> dict:
        """GET /status: participants, the stalled ones, queue depths and ages, the published weights."""
        participants, stalled = self.heartbeats.snapshot(stall_warn)
        depths, ages = self.scorer.depths(), self.scorer.ages()
        w = self.weights.info()
        return {
            "time": time.time(), "uptime_s": round(time.time() - self.metrics.started, 1), "stall_warn": stall_warn,
            "stopping": self.stopping, "participants": participants, "stalled": stalled,
            "hosts": by_host(participants),
            "queues": {"input": {"depth": depths["input"], "oldest_age_s": ages["input"]},
                       "output": {"depth": depths["output"], "oldest_age_s": ages["output"]},
                       "scoring": depths["scoring"]},
            "ref_forward": {"batches_scored": self.metrics.scored, "batches_ref_skipped": self.metrics.ref_skipped,
                            "padding_free": self.metrics.padding_free,
                            "padding_share": round(self.metrics.padding_share(), 4)},
            "weights": {"version": w["version"], "bytes": w["bytes"],
                        "age_s": None if w["published_at"] is None else round(time.time() - w["published_at"], 1),
                        "max_weights_mb": round(self.weights_limit.mb, 1), "max_weights_how": self.weights_limit.how},
            "placement": self.placement,
        }

    def health(self) -> dict:
        p = next(self.model.parameters())
        return {
            "status": "stopping" if self.stopping else "ok",
            "model": self.cfg.model, "vocab_size": self.vocab_size, "max_seq_len": self.max_seq_len,
            "dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device),
            "queues": self.scorer.depths(), "max_queue": self.cfg.max_queue,
            "max_output_queue": self.cfg.max_output_queue, "auth": self.token is not None,
            "uptime_s": round(time.time() - self.metrics.started, 3),
            "policy_version": self.weights.info()["version"],
            # who this is: a launcher checks that the server on its port is the one it started
            "pid": os.getpid(), "run_nonce": self.cfg.run_nonce,
        }
