"""Policy weights relay: trainer rank 0 publishes, genonly workers fetch (issue: workers follow the policy).

    PUT /weights?version=N   safetensors blob of the policy's parameters (token required when set), or a
                             delta against the version held (format=weights_delta, common/weights/delta.py)
    GET /weights/version     {"version": N | null, "bytes": size, "served_delta_bytes", "served_full_bytes", ...}
    GET /weights[?since=M]   the latest blob, header X-Policy-Version; 404 before the first publish. With
                             since=M and the last delta going from M to the latest: that delta instead

The ref server is the one place every process already reaches, so this works across nodes
with no shared filesystem. A full blob is only relayed, never deserialised here: the server
checks that it is a well-formed safetensors header and keeps one copy. A delta is checked in full
(checksum, names, shapes, positions) before the publish is answered, then applied to that copy in place (or
to a fresh copy while a fetch still streams it) in the background, so late or restarted workers still get
the full weights (their GET waits for the rebuild); the last delta is kept, and served at once, for workers
one version behind.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager

from common.weights.apply import apply_plan, plan_delta
from common.weights.blob import IntegrityError, tensors_from_blob
from common.weights.checksum import DIGITS, KEY, checksum
from common.weights.delta import DELTA_FORMAT, NEEDS_FULL, DeltaError
from common.weights.kernels import warm_soon
from ref_server.weight_io import BlobReader

log = logging.getLogger("ref_server")
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # safetensors dtype -> bytes


class WeightError(ValueError):
    """A publish the store refuses (bad blob, version not newer)."""


class StaleBase(WeightError):
    """A delta from another version than the one held (or none held): the publisher sends the full copy."""


def check_safetensors_blob(blob: bytes, header_out: dict | None = None) -> int:
    """Validate the framing of a safetensors blob without loading tensors; returns the tensor count
    (the header into `header_out` when given)."""
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
    meta = header.get("__metadata__")
    if count == 0 and not (isinstance(meta, dict) and meta.get("format") == DELTA_FORMAT):  # nothing changed: ok
        raise WeightError("weights blob holds no tensors")
    if header_out is not None:
        header_out.update(header)
    return count


class WeightStore:
    """The latest published weights and their policy version (monotonically increasing).

    The retired blob's memory is kept as a spare for the next publish of the same size, once no
    GET still streams it: touching hundreds of MB of fresh pages costs more than receiving the
    bytes. So between publishes the relay holds two copies (current + spare); during one it
    needs two anyway (the old one may still be streaming).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version: int | None = None
        self._blob: bytearray | None = None
        self._readers: dict[int, int] = {}  # id(blob) -> open BlobReaders (each holds its blob alive)
        self._spare: bytearray | None = None
        self._published_at: float | None = None
        self._delta: tuple[int, int, bytearray] | None = None  # (version, base version, blob) of the last delta
        self._served = {"delta": 0, "full": 0}  # bytes sent to workers, by kind (the trainer's sync_mb_down_*)
        self._delta_check: str | None = None  # the last rebuilt copy's checksum check: pending, ok or failed
        self._warmed = False
        self._rebuilding: threading.Event | None = None  # set once the copy rebuilt from the last delta is whole

    def buffer(self, size: int) -> bytearray:
        """Memory for an incoming publish of `size` bytes: the spare when it fits, else fresh."""
        with self._lock:
            if self._spare is not None and len(self._spare) == size:
                buf, self._spare = self._spare, None
                return buf
            if self._spare is None or size > len(self._spare) // 2:
                self._spare = None  # a different full copy: let it go rather than hold three copies
        return bytearray(size)  # (a delta: the spare stays for the next full copy)

    def publish(self, version: int, blob: bytearray) -> None:
        header: dict = {}
        count = check_safetensors_blob(blob, header)
        if (header.get("__metadata__") or {}).get("format") == DELTA_FORMAT:
            return self._publish_delta(version, blob, header["__metadata__"], count)
        with self._settled():
            if self._version is not None and version <= self._version:
                raise WeightError(f"version {version} is not newer than the current {self._version}")
            old, self._version, self._blob, self._delta = self._blob, version, blob, None
            self._delta_check = None
            self._published_at = time.time()
            self._retire(old)
            first, self._warmed = not self._warmed, True
        if first:  # the delta kernels compiled (or loaded from numba's cache) before the first delta needs them
            sizes = {_ITEMSIZE.get(v.get("dtype"), 1) for k, v in header.items() if k != "__metadata__"}
            warm_soon(sizes)
        log.info("policy weights v%d published (%d tensors, %.1f MB)", version, count, len(blob) / 1e6)

    @contextmanager
    def _settled(self):
        """The lock, once no copy is being rebuilt from a delta (a full GET or the next publish needs it whole)."""
        while True:
            self._lock.acquire()
            rebuilding = self._rebuilding
            if rebuilding is None or rebuilding.is_set():
                break
            self._lock.release()
            rebuilding.wait()
        try:
            yield
        finally:
            self._lock.release()

    def _publish_delta(self, version: int, delta: bytearray, meta: dict, count: int) -> None:
        """Check the delta in full against the copy held, take it as the new version (workers one version behind
        fetch it at once), and rebuild the full copy from it in the background (full GETs wait for that)."""
        try:
            changes = tensors_from_blob(delta)  # its own checksum first: a truncated or corrupt delta changes nothing
        except (IntegrityError, ValueError) as e:
            raise WeightError(f"weights delta refused: {e}") from None
        base = str(meta.get("base_version", ""))
        with self._settled():  # a fetch already streaming the copy keeps it: the rebuild writes into other memory
            if self._blob is None or not base.isdigit() or int(base) != self._version:
                raise StaleBase(f"delta from v{base}, this server holds v{self._version}: {NEEDS_FULL}")
            if self._delta_check == "failed":
                raise StaleBase(f"the copy rebuilt for v{self._version} failed its checksum check: {NEEDS_FULL}")
            if version <= self._version:
                raise WeightError(f"version {version} is not newer than the current {self._version}")
            full = self._blob
            n = int.from_bytes(full[:8], "little")
            old_crc = f'"{KEY}":"{meta.get("base_xxh3")}"'.encode()
            at = full.find(old_crc, 8, 8 + n)
            new_crc = str(meta.get("full_xxh3", ""))
            if at < 0 or len(new_crc) != DIGITS:
                raise StaleBase(f"delta from xxh3 {meta.get('base_xxh3')} does not fit the copy held: {NEEDS_FULL}")
            try:
                steps = plan_delta(tensors_from_blob(full, verify=False), changes)  # before any byte changes
            except DeltaError as e:
                raise WeightError(f"weights delta refused: {e}") from None
            target = full
            if self._readers.get(id(full)):  # being streamed: write the new version into other memory
                target = self._spare if self._spare is not None and len(self._spare) == len(full) else None
                self._spare = None
                target = bytearray(full) if target is None else _copy_into(target, full)
            self._version, self._blob, self._delta = version, target, (version, int(base), delta)
            self._published_at = time.time()
            self._retire(full)
            self._delta_check = "pending"
            self._readers[id(target)] = self._readers.get(id(target), 0) + 1  # the rebuild and check: no writes
            self._rebuilding = done = threading.Event()
        threading.Thread(target=self._rebuild, args=(version, target, steps, at + len(f'"{KEY}":"'), new_crc,
                                                     8 + n, done), daemon=True, name="weights-rebuild").start()
        log.info("policy weights v%d published as a delta from v%s (%d tensors, %.1f MB)", version, base, count,
                 len(delta) / 1e6)

    def _rebuild(self, version: int, blob: bytearray, steps: list, crc_at: int, crc: str, start: int,
                 done: threading.Event) -> None:
        """Write a checked delta into the full copy and its checksum into the header; then check the result.
        At a lower CPU priority: on a shared host the workers applying the same delta come first."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: same priority as the rest
        try:
            apply_plan(tensors_from_blob(blob, verify=False), steps)
            blob[crc_at:crc_at + DIGITS] = crc.encode()
        except Exception:  # plan_delta checked every part: only a bug gets here, and the next delta goes in full
            log.exception("policy weights v%d: rebuilding the full copy from the delta failed", version)
            with self._lock:
                if self._version == version:
                    self._delta_check = "failed"
            done.set()
            self._reader_closed(blob)
            return
        done.set()
        self._check(version, blob, start, crc)

    def _check(self, version: int, blob: bytearray, start: int, want: str) -> None:
        """The checksum of a copy rebuilt from a delta, off the publish's path: a copy that does not match the
        trainer's (a bug, bad memory) makes the next delta a 409, so the trainer sends the full copy."""
        got = checksum(memoryview(blob)[start:])
        with self._lock:
            if self._version == version:
                self._delta_check = "ok" if got == want else "failed"
        if got != want:
            log.error("policy weights v%d rebuilt from a delta have xxh3 %s, the trainer's have %s: asking for the "
                      "full copy at the next publish", version, got, want)
        self._reader_closed(blob)

    def _retire(self, blob: bytearray | None) -> None:  # under the lock
        if isinstance(blob, bytearray) and blob is not self._blob and not self._readers.get(id(blob)):
            self._spare = blob  # nobody reads it any more: reusable (an older spare is freed)

    def info(self) -> dict:
        with self._lock:
            return {"version": self._version, "bytes": len(self._blob) if self._blob is not None else 0,
                    "published_at": self._published_at,
                    "delta_from": self._delta[1] if self._delta else None,
                    "delta_bytes": len(self._delta[2]) if self._delta else 0, "delta_check": self._delta_check,
                    "served_delta_bytes": self._served["delta"], "served_full_bytes": self._served["full"]}

    def open_latest(self, since: int | None = None) -> tuple[int | None, BlobReader | None, str]:
        """(version, reader, "full" or "delta") of the newest weights; (None, None, "full") before the first
        publish. The delta when the caller holds `since` and the last delta goes from there to the newest
        (at once); else the full copy (once it is rebuilt from the last delta)."""
        with self._lock:
            if since is not None and self._delta is not None and self._delta[:2] == (self._version, since):
                self._served["delta"] += len(self._delta[2])
                return self._version, BlobReader(self._delta[2]), "delta"  # small: no spare bookkeeping
        with self._settled():
            blob = self._blob
            if blob is None:
                return None, None, "full"
            if since is not None and self._delta is not None and self._delta[:2] == (self._version, since):
                self._served["delta"] += len(self._delta[2])  # published while we waited
                return self._version, BlobReader(self._delta[2]), "delta"
            self._readers[id(blob)] = self._readers.get(id(blob), 0) + 1
            self._served["full"] += len(blob)
            return self._version, BlobReader(blob, on_close=self._reader_closed), "full"

    def _reader_closed(self, blob: bytearray) -> None:
        with self._lock:
            n = self._readers.get(id(blob), 0) - 1
            if n > 0:
                self._readers[id(blob)] = n
                return
            self._readers.pop(id(blob), None)
            if self._spare is None:
                self._retire(blob)


def _copy_into(dst: bytearray, src: bytearray) -> bytearray:
    dst[:] = src
    return dst
