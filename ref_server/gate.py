"""The ref server's request gate: the bearer token and the per-path body limits are applied by waitress'
parser as soon as a request's headers are in, before any byte of its body is allocated, buffered or
spooled to disk.

waitress dispatches a request only once its whole body has arrived, and its one cap
(max_request_body_size) must fit the weights (a model's size: ref_server/weights_limit.py). Without this
gate a stranger could make the server allocate a declared Content-Length (PUT /weights preallocates it)
or spool a chunked body to a temp file before the app ever answers 401/413. Here such a request completes
at once without a body: the app answers from the headers (401 for a missing token, 413 over the limit),
and the connection closes after the answer, so the bytes that follow are never read as a request.
"""
from __future__ import annotations

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser, ParsingError, TransferEncodingNotImplemented
from waitress.receiver import FixedStreamReceiver

from ref_server.auth import _authorized
from ref_server.config import ServerConfig
from ref_server.weight_io import PreallocatedBody
from ref_server.weights import WeightStore


def make_channel(cfg: ServerConfig, token: str | None, weights: WeightStore,
                 max_weights_bytes: int) -> type[HTTPChannel]:
    """waitress channel class applying the gate; the token check is the app's own (constant-time).
    max_weights_bytes: the limit on PUT /weights in force (ref_server/weights_limit.py)."""

    class Parser(HTTPRequestParser):
        refused = False  # the body is not ours to read: the rest of this connection is dropped

        def limit(self) -> int:
            return max_weights_bytes if self.path == "/weights" else cfg.max_body_bytes

        def refuse_body(self) -> None:
            """Complete now without the body; the app answers from the headers; waitress closes after."""
            self.body_rcv, self.refused, self.expect_continue = None, True, False
            self.headers["CONNECTION"] = "close"
            # The app reads the declared length from the headers. waitress' own check of it against
            # max_request_body_size comes after this hook and would answer first, with a plain-text 413
            # that names neither the limit nor the knob (any publish past the limit + 1 MiB).
            self.content_length = 0

        def parse_header(self, header_plus: bytes) -> None:
            try:
                super().parse_header(header_plus)
            except TransferEncodingNotImplemented as e:  # a client error: 400, never a 5xx (waitress: 501)
                raise ParsingError(str(e)) from None
            has_body = self.chunked or self.content_length > 0
            if has_body and not _authorized(token, {"HTTP_AUTHORIZATION": self.headers.get("AUTHORIZATION", "")}):
                self.refuse_body()  # every route that takes a body requires the token: the app answers 401
            elif not self.chunked and self.content_length > self.limit():
                self.refuse_body()  # the app sees CONTENT_LENGTH and answers 413
            elif self.path == "/weights" and self.command == "PUT" and not self.chunked and self.content_length:
                # authorized: receive straight into one bytearray (no temp file, no copy)
                body = PreallocatedBody(self.content_length, alloc=weights.buffer)
                self.body_rcv = FixedStreamReceiver(self.content_length, body)

        def received(self, data: bytes) -> int:
            if self.refused:
                return len(data)  # the rest of this read belongs to the refused body
            n = super().received(data)
            if self.refused:  # refused at the header just parsed: nothing after it is a request
                return len(data)
            if self.chunked and not self.completed and self.body_rcv is not None \
                    and len(self.body_rcv) > self.limit():
                # a chunked body grew past the path's limit: stop here, the app answers 413 from the length
                got = len(self.body_rcv)
                self.body_rcv.buf.close()  # the part spooled so far (at most one read past the limit)
                self.refuse_body()
                self.headers["CONTENT_LENGTH"] = str(got)
                self.completed = True
                return len(data)
            return n

    class Channel(HTTPChannel):
        parser_class = Parser

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # waitress sends at most SO_SNDBUF (16 KB at accept) per call: 30,000 Python-level sends
            # for a 500 MB weights blob. Offer 4 MB; the kernel takes what fits (slices, no copies).
            self.sendbuf_len = max(self.sendbuf_len, 4 << 20)

    return Channel
