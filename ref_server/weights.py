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
import time

log = logging.getLogger("ref_server")


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

    def buffer(self, size: int) -> bytearray:
        """Memory for an incoming publish of `size` bytes: the spare when it fits, else fresh."""
        with self._lock:
            if self._spare is not None and len(self._spare) == size:
                buf, self._spare = self._spare, None
                return buf
            self._spare = None  # a different size: let it go rather than hold three copies
        return bytearray(size)

    def publish(self, version: int, blob: bytearray) -> None:
        count = check_safetensors_blob(blob)
        with self._lock:
            if self._version is not None and version <= self._version:
                raise WeightError(f"version {version} is not newer than the current {self._version}")
            old, self._version, self._blob = self._blob, version, blob
            self._published_at = time.time()
            self._retire(old)
        log.info("policy weights v%d published (%d tensors, %.1f MB)", version, count, len(blob) / 1e6)

    def _retire(self, blob: bytearray | None) -> None:  # under the lock
        if isinstance(blob, bytearray) and blob is not self._blob and not self._readers.get(id(blob)):
            self._spare = blob  # nobody reads it any more: reusable (an older spare is freed)

    def info(self) -> dict:
        with self._lock:
            return {"version": self._version, "bytes": len(self._blob) if self._blob is not None else 0,
                    "published_at": self._published_at}

    def open_latest(self) -> tuple[int | None, BlobReader | None]:
        """(version, reader) of the newest weights; (None, None) before the first publish."""
        with self._lock:
            blob = self._blob
            if blob is None:
                return None, None
            self._readers[id(blob)] = self._readers.get(id(blob), 0) + 1
            return self._version, BlobReader(blob, on_close=self._reader_closed)

    def _reader_closed(self, blob: bytearray) -> None:
        with self._lock:
            n = self._readers.get(id(blob), 0) - 1
            if n > 0:
                self._readers[id(blob)] = n
                return
            self._readers.pop(id(blob), None)
            if self._spare is None:
                self._retire(blob)


class BlobReader:
    """A read-only file over the blob whose reads are memoryview slices, not copies.

    Returned from GET /weights, Bottle hands it to waitress' wsgi.file_wrapper, which sends
    straight from these slices: no per-chunk copy and no response buffer of the blob's size.
    """

    def __init__(self, blob: bytearray, on_close=None) -> None:
        self.blob, self.view, self.pos, self.on_close = blob, memoryview(blob), 0, on_close

    def read(self, n: int = -1) -> memoryview:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = self.view[self.pos:end]
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, min(len(self.view), {0: 0, 1: self.pos, 2: len(self.view)}[whence] + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:  # waitress may close twice (sent, then channel closed): once counts
        if self.on_close is not None:
            self.view = memoryview(b"")
            on_close, self.on_close = self.on_close, None
            on_close(self.blob)


class PreallocatedBody:
    """waitress request-body buffer for PUT /weights: one bytearray of the declared Content-Length.

    waitress' own buffer spools any body over 512 KB to a temp file, which the app then copies
    back into memory: two extra passes over hundreds of MB. This one is filled as the bytes arrive
    and handed to the app as is (`BodyFile.body`).
    """

    def __init__(self, size: int, alloc=bytearray) -> None:
        self.data = alloc(size)
        self.view = memoryview(self.data)
        self.n = 0

    def __len__(self) -> int:  # bytes received so far (waitress checks it against its body cap)
        return self.n

    def append(self, s: bytes) -> None:
        k = min(len(s), len(self.data) - self.n)  # waitress never passes more than Content-Length
        self.view[self.n:self.n + k] = s[:k]
        self.n += k

    def getfile(self) -> BodyFile:
        return BodyFile(self)

    def close(self) -> None:  # waitress closes the request; the data may live on in the WeightStore
        self.view.release()


class BodyFile:
    """wsgi.input over a PreallocatedBody: `body` is the whole received bytearray (no copy)."""

    def __init__(self, buf: PreallocatedBody) -> None:
        self.buf, self.pos = buf, 0

    @property
    def body(self) -> bytearray:
        return self.buf.data if self.buf.n == len(self.buf.data) else self.buf.data[:self.buf.n]

    def read(self, n: int = -1) -> bytes:
        end = self.buf.n if n is None or n < 0 else min(self.buf.n, self.pos + n)
        out = bytes(self.buf.data[self.pos:end])
        self.pos = end
        return out
