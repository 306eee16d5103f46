"""Policy weight sync: the trainer publishes versioned weights, genonly workers follow them.

Two transports with one interface:
- HTTP through the ref server (`PUT/GET /weights`), for nodes that share no filesystem;
- a shared directory (`sync_dir`), written atomically (temp file + rename), where users have one.

Weights travel as safetensors (named parameters, tied weights once), never pickled. A worker
copies the fetched tensors into its live parameters in place and drops the blob, so it holds
two full copies only during the swap.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)


def parameters_blob(model: torch.nn.Module) -> bytes:
    """Serialise every named parameter (shared/tied ones once) as one safetensors blob."""
    return st_save({n: p.detach().contiguous().cpu() for n, p in model.named_parameters()})


def load_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters in place; every parameter must be there with its shape."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"weights: {name} has shape {tuple(t.shape)}, model has {tuple(p.shape)}")
            p.copy_(t.to(dtype=p.dtype, device=p.device))


class WeightSync:
    """Publish (trainer rank 0) or follow (workers) the policy weights. Either `client` or `sync_dir`."""

    def __init__(self, client=None, sync_dir: Optional[str] = None):
        if (client is None) == (sync_dir is None):
            raise ValueError("WeightSync needs exactly one of client (HTTP) or sync_dir (shared directory)")
        self.client = client
        self.dir = Path(sync_dir) if sync_dir else None
        self.version: Optional[int] = None  # the version this process's model holds
        self.bytes_moved = 0
        self.seconds = 0.0

    # ---- trainer side -------------------------------------------------------------------
    def publish(self, model: torch.nn.Module, version: int) -> tuple[float, int]:
        """Publish the model's weights as `version`; returns (seconds, bytes)."""
        t0 = time.time()
        blob = parameters_blob(model)
        if self.client is not None:
            self.client.publish_weights(blob, version)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            final = self.dir / f"policy-v{version}.safetensors"
            tmp = final.with_suffix(".tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, final)
            latest = self.dir / "latest.json"
            tmp_latest = self.dir / "latest.json.tmp"
            tmp_latest.write_text(json.dumps({"version": version, "file": final.name}))
            os.replace(tmp_latest, latest)
            for old in self.dir.glob("policy-v*.safetensors"):  # keep only the newest
                if old != final:
                    old.unlink(missing_ok=True)
        self.version = version
        dt = time.time() - t0
        self.bytes_moved += len(blob)
        self.seconds += dt
        return dt, len(blob)

    # ---- worker side --------------------------------------------------------------------
    def latest_version(self) -> Optional[int]:
        if self.client is not None:
            return self.client.weights_version()
        try:
            return int(json.loads((self.dir / "latest.json").read_text())["version"])
        except FileNotFoundError:
            return None

    def follow(self, model: torch.nn.Module) -> Optional[int]:
        """Fetch and apply the newest weights if they are newer than ours; returns the new version or None."""
        latest = self.latest_version()
        if latest is None or (self.version is not None and latest <= self.version):
            return None
        t0 = time.time()
        if self.client is not None:
            version, blob = self.client.fetch_weights()
            tensors = st_load(blob)
            del blob  # the tensors own their memory now
        else:
            meta = json.loads((self.dir / "latest.json").read_text())
            version = int(meta["version"])
            try:
                tensors = load_file(self.dir / meta["file"])
            except FileNotFoundError:  # superseded while we read the pointer: catch the next one
                return None
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        load_parameters(model, tensors)
        del tensors
        self.version = version
        dt = time.time() - t0
        self.seconds += dt
        self.bytes_moved += moved
        log.info("policy weights v%d applied in %.2f s (%.1f MB)", version, dt, moved / 1e6)
        return version
