"""Policy weight sync: the trainer publishes versioned weights, genonly workers follow them.

Two transports with one interface:
- HTTP through the ref server (`PUT/GET /weights`), for nodes that share no filesystem;
- a shared directory (`sync_dir`), written atomically (temp file + rename), where users have one.

Weights travel as safetensors (common/weights/blob.py: named parameters, tied weights once), never pickled. A worker
copies the fetched tensors into its live parameters in place and drops the blob, so it holds
two full copies only during the swap.

Integrity: every blob carries the XXH3-64 checksum (common/weights/checksum.py) of its data section in the safetensors
header (`__metadata__["xxh3"]`); a worker verifies it before loading anything, retries a download that
broke, stalled or fails the check (keeping its current weights meanwhile), and only ever moves to
a newer version.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from common.weights.apply import HeldWeights
from common.weights.blob import IntegrityError, ParametersBody, blob_metadata, tensors_from_blob
from common.weights.checksum import KEY
from common.weights.delta import DELTA_FORMAT, NEEDS_FULL, DeltaEncoder, DeltaError

log = logging.getLogger(__name__)


def load_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Copy tensors into the model's parameters in place; every parameter must be there with its shape
    (partial: only those that changed, from a delta)."""
    params = dict(model.named_parameters())
    missing = [] if partial else sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"weights: {name} has shape {tuple(t.shape)}, model has {tuple(p.shape)}")
            p.copy_(t.to(dtype=p.dtype, device=p.device))


class WeightSync:
    """Publish (trainer rank 0) or follow (workers) the policy weights. Either `client` or `sync_dir`.

    delta=True (HTTP only; a shared directory keeps full copies): the publisher sends only what changed
    since its last publish and the follower asks for only what changed since the version it holds
    (common/weights/delta.py); either falls back to a full copy, and says so, when the chain is broken."""

    def __init__(self, client=None, sync_dir: str | None = None, adapter_loader=None, delta: bool = False,
                 delta_max_share: float | None = None):
        if (client is None) == (sync_dir is None):
            raise ValueError("WeightSync needs exactly one of client (HTTP) or sync_dir (shared directory)")
        self.client = client
        # adapter_loader(model, tensors, metadata): applies an adapter-only blob
        # (LoRA; trainer/lora/adapters.py LoraMerger)
        self.adapter_loader = adapter_loader
        self.dir = Path(sync_dir) if sync_dir else None
        self.delta = delta and client is not None
        if delta_max_share is not None and not 0 <= delta_max_share:
            raise ValueError(f"sync_delta_max_share must be >= 0 (a share of the full weights), got {delta_max_share}")
        self.delta_max_share = delta_max_share  # None: common/weights/delta.py DELTA_MAX_SHARE
        self.encoder: DeltaEncoder | None = None  # publisher: the last published copy
        self.held: HeldWeights | None = None  # follower: the full weights last received, for deltas
        self.last_kind = "full"  # what the last publish or follow moved: "full" or "delta"
        self.delta_bytes = 0  # the size of the last delta encoded (0 when it went in full: over delta_max_share)
        self.version: int | None = None  # the version this process's model holds
        self.bytes_moved = 0
        self.seconds = 0.0

    # ---- trainer side -------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int, dtype: torch.dtype | None = None, named=None,
                metadata: dict[str, str] | None = None, weights: dict[str, torch.Tensor] | None = None
                ) -> tuple[float, int]:
        """Publish the model's weights (or just `named` ones, described by `metadata`) as `version`, floating
        ones in `dtype` when given; returns (seconds, bytes). `last_kind` says whether it was a delta.
        weights: {name: tensor} standing for model.named_parameters(), in its order (a ZeRO-3 model's CPU copies,
        gathered a group at a time: trainer/dist/gather.py); the model itself is then not read."""
        t0 = time.time()
        full = list(weights.items()) if weights is not None else None  # None: the model's named_parameters()
        try:
            if self.delta and named is None:
                body, self.last_kind = self._delta_body(model, dtype, full)
            else:
                body = ParametersBody(model, dtype, named=named if named is not None else full, metadata=metadata)
                self.last_kind = "full"
            if self.client is None:
                self._write_dir(body, version)
            elif self.last_kind == "full":
                self.client.publish_weights(body, version)
            else:
                body = self._publish_delta(body, version)
        except BaseException:
            self.encoder = None  # the server may not hold what the copy says: start over with a full copy
            raise
        self.version = version
        dt = time.time() - t0
        self.bytes_moved += len(body)
        self.seconds += dt
        return dt, len(body)

    def _delta_body(self, model, dtype, full=None) -> tuple[ParametersBody, str]:
        params = full if full is not None else model.named_parameters()
        if self.encoder is None or self.encoder.dtype != dtype or self.version is None:
            self.encoder = DeltaEncoder(dtype, self.delta_max_share)
            return ParametersBody(None, named=self.encoder.snapshot(params), crc=self.encoder.crc), "full"
        tensors, meta = self.encoder.delta(params)
        self.delta_bytes = self.encoder.delta_bytes  # data; the header is small
        if self.encoder.gave_up:  # over delta_max_share: the full copy costs everyone less
            return ParametersBody(None, named=list(self.encoder.last.items()), crc=self.encoder.crc), "full"
        return ParametersBody(None, named=tensors, metadata={**meta, "base_version": str(self.version)}), "delta"

    def _publish_delta(self, body: ParametersBody, version: int) -> ParametersBody:
        from common.wire.client import RefServerError

        try:
            self.client.publish_weights(body, version)
            return body
        except RefServerError as e:
            if NEEDS_FULL not in e.message:
                raise
            log.warning("delta for v%d refused (%s); publishing the full copy", version, e.message)
        body = ParametersBody(None, named=list(self.encoder.last.items()), crc=self.encoder.crc)
        self.last_kind = "full"
        self.client.publish_weights(body, version)
        return body

    def _write_dir(self, body: ParametersBody, version: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"policy-v{version}.safetensors"
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            body.write_to(f)
        os.replace(tmp, final)
        latest = self.dir / "latest.json"
        tmp_latest = self.dir / "latest.json.tmp"
        tmp_latest.write_text(json.dumps({"version": version, "file": final.name}))
        os.replace(tmp_latest, latest)
        for old in self.dir.glob("policy-v*.safetensors"):  # keep only the newest
            if old != final:
                old.unlink(missing_ok=True)

    # ---- worker side --------------------------------------------------------------------
    def is_newer(self, published: int | None) -> bool:
        """`published` is a version this process has not applied (None: nothing published; nothing held yet: any)."""
        return published is not None and (self.version is None or published > self.version)

    def latest_version(self) -> int | None:
        if self.client is not None:
            return self.client.weights_version()
        try:
            return int(json.loads((self.dir / "latest.json").read_text())["version"])
        except FileNotFoundError:
            return None

    def _fetch(self) -> tuple[int, dict[str, torch.Tensor], dict[str, str]] | None:
        """(version, verified tensors, metadata) of the newest weights; None if the shared file was superseded.
        With delta on and a full copy held, the server answers with a delta when it has one from there."""
        if self.client is not None:
            version, blob = self.client.fetch_weights(since=self.held.version if self.held is not None else None)
            # views into blob: freed together after the copy (or kept as `held`)
            return version, tensors_from_blob(blob), blob_metadata(blob)
        meta = json.loads((self.dir / "latest.json").read_text())
        try:
            blob = bytearray((self.dir / meta["file"]).read_bytes())
        except FileNotFoundError:  # superseded while we read the pointer: catch the next one
            return None
        return int(meta["version"]), tensors_from_blob(blob), blob_metadata(blob)

    def _fetch_retrying(self, retries: int, backoff: float):
        from common.wire.client import RefServerError

        for attempt in range(retries + 1):
            try:
                return self._fetch()
            except (RefServerError, IntegrityError) as e:
                if isinstance(e, RefServerError) and e.status not in (0, 503):
                    raise
                keep = "no weights yet" if self.version is None else f"v{self.version}"
                if self.client is not None and self.client.give_up():  # the process is stopping: no retries
                    log.info("weights download failed (%s) while stopping; keeping %s", e, keep)
                    return None
                if attempt == retries:
                    log.error("weights download failed %d times (%s); keeping %s, trying again later",
                              retries + 1, e, keep)
                    return None
                log.warning("weights download failed (%s); keeping %s, retry %d of %d", e, keep, attempt + 1,
                            retries)
                time.sleep(min(backoff * 2 ** attempt, 10.0))

    def follow(self, model: torch.nn.Module | None = None, apply=None, retries: int = 5, backoff: float = 0.5
               ) -> int | None:
        """Fetch and apply the newest weights if they are newer than ours; returns the new version or None.

        `apply(tensors, metadata)` loads them somewhere else than an HF model's parameters (a generation
        engine); metadata says whether they are full weights, a delta (then `tensors` are the full new values
        of the tensors that changed) or a LoRA adapter (trainer/lora/adapters.py).
        A download that breaks, stalls or fails its checksum is logged and retried up to `retries`
        times; the model keeps its current weights meanwhile (and after the last failure). A delta that
        does not rebuild the trainer's weights exactly is never loaded: the full copy is fetched instead."""
        if not self.is_newer(self.latest_version()):
            return None
        t0 = time.time()
        got = self._fetch_retrying(retries, backoff)
        if got is None:
            return None
        version, tensors, metadata = got
        if self.version is not None and version <= self.version:  # versions only move forward
            log.warning("ignoring policy weights v%d: not newer than the v%d we hold", version, self.version)
            return None
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        self.bytes_moved += moved
        self.last_kind = "delta" if metadata.get("format") == DELTA_FORMAT else "full"
        if self.last_kind == "delta":
            try:
                if self.held is None:
                    raise DeltaError("a delta arrived, and no full copy is held to apply it to")
                changed = self.held.apply(tensors, metadata, version)
            except DeltaError as e:
                log.error("policy weights delta not applied (%s); refetching the full copy", e)
                self.held = None  # possibly half-written: the engine never saw it, the full copy replaces it
                return self.follow(model, apply, retries, backoff)
            tensors = {name: self.held.tensors[name] for name in changed}
        else:  # a full copy (kept for deltas) or an adapter (LoRA: never delta'd)
            self.held = (HeldWeights(tensors, version, metadata[KEY])
                         if self.delta and metadata.get("format") == "pt" else None)
        if (self.held is not None and self.held.in_model) or (self.last_kind == "delta" and not tensors):
            pass  # the delta went straight into the model's parameters, or nothing changed
        elif apply is not None:
            apply(tensors, metadata)
        elif metadata.get("format") == "lora_adapter":
            if self.adapter_loader is None:
                raise ValueError("the trainer publishes LoRA adapters only, and this follower has no adapter loader")
            self.adapter_loader(model, tensors, metadata)
        else:
            load_parameters(model, tensors, partial=self.last_kind == "delta")
        if self.held is not None and apply is None and model is not None and not self.held.in_model:
            self.held = self.held.adopt(model)  # later deltas go straight into the parameters, when they can
        del tensors
        self.version = version
        dt = time.time() - t0
        self.seconds += dt
        log.info("policy weights v%d applied in %.2f s (%s, %.1f MB)", version, dt, self.last_kind, moved / 1e6)
        return version
