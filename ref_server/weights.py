"""Policy weights relay: trainer rank 0 publishes, genonly workers fetch (issue: workers follow the policy).

    PUT /weights?version=N   safetensors blob of the policy's parameters (token required when set)
    GET /weights/version     {"version": N | null, "bytes": size}
    GET /weights             the latest blob, header X-Policy-Version; 404 before the first publish

The ref server is the one place every process already reaches, so this works across nodes
with no shared filesystem. The blob is only relayed, never deserialised here: the server
checks that it is a well-formed safetensors header and keeps one copy.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Iterator, Optional

log = logging.getLogger("ref_server")

STREAM_CHUNK = 4 << 20


class WeightError(ValueError):
    """A publish the store refuses (bad blob, version not newer)."""


def check_safetensors_blob(blob: bytes) -> int:
    """Validate the framing of a safetensors blob without loading tensors; returns the tensor count."""
    if len(blob) < 8:
        raise WeightError("weights blob too short")
    n = int.from_bytes(blob[:8], "little")
    if n > len(blob) - 8 or n > 100 << 20:
        raise WeightError("weights blob header length out of range")
    try:
        header = json.loads(bytes(blob[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightError(f"weights blob header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WeightError("weights blob header is not an object")
    data_len = len(blob) - 8 - n
    count = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise WeightError(f"tensor {name!r} has bad data_offsets")
        count += 1
    if count == 0:
        raise WeightError("weights blob holds no tensors")
    return count


class WeightStore:
    """The latest published weights and their policy version (monotonically increasing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version: Optional[int] = None
        self._blob: Optional[bytes] = None

    def publish(self, version: int, blob: bytes) -> None:
        count = check_safetensors_blob(blob)
        with self._lock:
            if self._version is not None and version <= self._version:
                raise WeightError(f"version {version} is not newer than the current {self._version}")
            self._version, self._blob = version, blob  # the old blob is freed here
        log.info("policy weights v%d published (%d tensors, %.1f MB)", version, count, len(blob) / 1e6)

    def info(self) -> dict:
        with self._lock:
            return {"version": self._version, "bytes": len(self._blob) if self._blob is not None else 0}

    def latest(self) -> tuple[Optional[int], Optional[bytes]]:
        with self._lock:
            return self._version, self._blob


def stream(blob: bytes) -> Iterator[bytes]:
    """Chunks of the blob, so the WSGI server does not need a second full copy."""
    view = memoryview(blob)
    for s in range(0, len(view), STREAM_CHUNK):
        yield bytes(view[s:s + STREAM_CHUNK])
