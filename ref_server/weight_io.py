"""Streaming buffers of the weights relay (ref_server/weights.py): a reader that sends a blob without copying it,
and a request body that receives one into a single preallocated bytearray."""
from __future__ import annotations


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
