"""Rank 0 publishes the live policy for the genonly workers (common/weights/sync.py: HTTP relay or sync_dir):
every sync_steps steps, full weights, only what changed since the last publish (sync_delta,
common/weights/delta.py) or only the LoRA adapters, in worker_dtype. Under ZeRO-3 every rank gathers the
weights a bounded group at a time and rank 0 publishes its CPU copies of them (trainer/dist/gather.py).
Metrics: sync_mb_up_{delta,full} (published) and sync_mb_down_{delta,full} (what the ref
server sent to workers since the previous publish), sync_mb their sum."""
from __future__ import annotations

import logging

import torch

from common.modeling import pick_dtype
from common.weights.sync import WeightSync
from common.wire.client import RefServerError
from trainer.dist.gather import GATHER_BUCKET_BYTES, cpu_copies
from trainer.lora.adapters import adapter_metadata, adapter_parameters, adapter_tensors, base_name, is_lora

log = logging.getLogger("trainer")


class Publisher:
    def __init__(self, cfg, client, policy, deepspeed, rank: int, zero_stage: int, budget: int = GATHER_BUCKET_BYTES):
        self.policy, self.deepspeed, self.rank, self.zero_stage = policy, deepspeed, rank, zero_stage
        self.budget = budget  # bytes gathered at once under ZeRO-3
        self.lora = is_lora(policy)
        self.syncer = None  # nobody to publish to: no workers, or workers that keep their weights
        if cfg.num_gen_workers > 0 and cfg.sync_steps > 0:
            self.syncer = WeightSync(client=None if cfg.sync_dir else client, sync_dir=cfg.sync_dir,
                                     delta=cfg.sync_delta and not self.lora,
                                     delta_max_share=cfg.sync_delta_max_share)
        self.client = None if cfg.sync_dir else client
        self.served: dict[str, float] | None = None  # the server's bytes sent to workers at the last publish
        # workers with an explicit dtype get the weights in it (bf16: half the bytes through the relay)
        self.dtype = None if cfg.worker_dtype == "auto" else pick_dtype(cfg.worker_dtype, torch.device("cpu"))

    @property
    def active(self) -> bool:
        return self.syncer is not None

    def publish(self, version: int) -> dict:
        """Called on every rank; returns the sync_s / sync_mb metrics (rank 0's figures, zeros elsewhere)."""
        if self.syncer is None:
            return {}
        weights = self._gathered() if self.zero_stage == 3 else None
        res = self._rank0(version, weights) if self.rank == 0 else (0.0, 0)
        up = {f"sync_mb_up_{k}": res[1] / 1e6 if self.syncer.last_kind == k and self.rank == 0 else 0.0
              for k in ("delta", "full")}
        down = self._downloads() if self.rank == 0 else {"sync_mb_down_delta": 0.0, "sync_mb_down_full": 0.0}
        return {"sync_s": res[0], "sync_mb": sum(up.values()) + sum(down.values()), **up, **down}

    def _downloads(self) -> dict:
        """MB the ref server sent to workers since the previous publish, delta and full (0 with sync_dir)."""
        now = {"delta": 0.0, "full": 0.0}
        if self.client is not None:
            try:
                info = self.client.weights_info()
                now = {k: float(info.get(f"served_{k}_bytes", 0)) for k in now}
            except RefServerError as e:  # metrics only: never fail a step for them
                log.warning("weights download counters unavailable: %s", e.message)
                now = dict(self.served or now)
        before, self.served = self.served or now, now
        return {f"sync_mb_down_{k}": max(now[k] - before[k], 0.0) / 1e6 for k in now}

    def _gathered(self) -> dict | None:
        """ZeRO-3, every rank: the published tensors gathered `budget` bytes at a time; rank 0 gets CPU copies in
        the publish dtype (by their published names), the others None."""
        if self.lora:
            got = cpu_copies(adapter_parameters(self.policy), 3, self.rank, self.dtype, self.budget)
            return None if got is None else {base_name(n): t for n, t in got.items()}
        return cpu_copies(self.policy.named_parameters(), 3, self.rank, self.dtype, self.budget)

    def _rank0(self, version: int, weights: dict | None = None) -> tuple[float, int]:
        """weights: the ZeRO-3 copies from _gathered (None: read the live model)."""
        try:
            if self.lora:  # adapter tensors only; workers merge them into their base weights (trainer/lora/adapters.py)
                named = adapter_tensors(self.policy) if weights is None else weights.items()
                return self.syncer.publish(self.policy, version, dtype=self.dtype, named=named,
                                           metadata=adapter_metadata(self.policy))
            return self.syncer.publish(self.policy, version, dtype=self.dtype, weights=weights)
        except RefServerError as e:
            if e.status == 413:  # over its max_weights_mb; the next publish is a full copy again, as big: end the run
                from trainer.run.health import WeightsRefused
                why = " ".join(e.message.split())  # the server's answer names the limit and the knob
                raise WeightsRefused(f"rank 0: ref server {e.url} refused the weights of step {version}: {why}"
                                     + ("" if "max_weights_mb" in why else " (its --max_weights_mb)")) from None
            if e.status != 409:
                raise
            # Resumed while the server kept weights of a later step from before the crash: it accepts
            # only newer versions, so publishing picks up again once the step count passes them.
            log.warning("policy v%d not published (%s); workers keep the server's weights until a newer step",
                        version, e.message)
            return 0.0, 0
