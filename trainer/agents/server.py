"""The endpoint over HTTP on 127.0.0.1: OpenAI's routes under each rollout's own path.

    server = AgentServer(endpoint)                 # a free port on 127.0.0.1, serving in a thread
    url = server.base_url(session)                 # http://127.0.0.1:PORT/<session id>/v1 (what the agent gets)
    server.close()

    POST <base_url>/chat/completions   POST <base_url>/completions   GET <base_url>/models

The session id in the path is the only key (any api_key is accepted: loopback only). Errors are OpenAI's shape,
`{"error": {message, type, param, code}}`: a request the endpoint refuses is a 4xx; only an engine failure is a 500.

Why the standard library's ThreadingHTTPServer, not uvicorn/starlette: it is in every install (uvicorn and fastapi
come with vLLM only, and an HF worker has no vLLM), a thread per connection suits calls that block on the engine's
batching queue (trainer/agents/batcher.py) with no event loop of its own to share with the agents', and the load is
a few hundred loopback calls a round, each waiting seconds on generation, not an ASGI server's throughput.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainer.agents.requests import ApiError, parse_body
from trainer.agents.responses import chat_chunks, text_chunks

log = logging.getLogger(__name__)
MAX_BODY = 64 * 2**20  # a request body past this is refused (413): a conversation, not a data upload
ROUTES = {"/v1/chat/completions": ("POST", "chat"), "/v1/completions": ("POST", "completions"),
          "/v1/models": ("GET", "models")}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for the SDK's connection pool: every reply has a Content-Length

    def log_message(self, fmt, *args) -> None:  # one line per call would flood a worker's log
        log.debug("agent endpoint: " + fmt, *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        try:
            raw = self._body()  # read first, whatever the route: a keep-alive connection must not keep its bytes
            self._route(method, raw)
        except ApiError as e:
            self._json(e.status, e.body())
        except Exception as e:  # the engine failed (not the request): a 500 the agent sees, and the log names it
            log.exception("agent endpoint: %s %s failed", method, self.path.split("/", 2)[-1])
            self._json(500, ApiError(500, f"the engine failed: {type(e).__name__}: {e}", kind="server_error").body())

    def _route(self, method: str, raw: bytes) -> None:
        ep = self.server.endpoint
        path = self.path.split("?", 1)[0]
        sid, _, rest = path.lstrip("/").partition("/")
        route = ROUTES.get("/" + rest.rstrip("/"))
        if route is None:
            raise ApiError(404, f"no route {path!r}: this endpoint serves <base_url>/chat/completions, "
                                f"/completions and /models", kind="not_found_error")
        session = ep.session(sid)
        want, kind = route
        if method != want:
            raise ApiError(405, f"{method} {'/' + rest}: use {want}", kind="invalid_request_error")
        if kind == "models":
            self._json(200, ep.models())
            return
        body = parse_body(raw, kind)
        done = ep.chat(session, body) if kind == "chat" else ep.text(session, body)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._sse(chat_chunks(done, usage) if kind == "chat" else text_chunks(done, usage))
        else:
            self._json(200, done.model_dump(mode="json"))

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None and self.command == "GET":
            return b""
        if length is None or not length.isdigit() or int(length) > MAX_BODY:
            self.close_connection = True  # what follows on this connection cannot be told from the body
            if length is None or not length.isdigit():
                raise ApiError(411, "the request needs a Content-Length header")
            raise ApiError(413, f"the request body is {length} bytes, over {MAX_BODY}")
        return self.rfile.read(int(length))

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, chunks: list) -> None:
        """Server-sent events, one `data:` line per chunk, then `data: [DONE]`; the connection closes after."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for c in chunks:
            self.wfile.write(b"data: " + json.dumps(c.model_dump(mode="json")).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection an agent left open does not hold the worker's exit
    request_queue_size = 1024  # listen backlog: a round's agents connect at once (the default 5 refused some of 32)


class AgentServer:
    def __init__(self, endpoint, host: str = "127.0.0.1", port: int = 0):
        self.httpd = _Server((host, port), _Handler)
        self.httpd.endpoint = endpoint
        self.endpoint = endpoint
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="agent-endpoint", daemon=True)  # close() waits at most one poll
        self._thread.start()

    def base_url(self, session) -> str:
        return f"http://{self.host}:{self.port}/{session.id}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
        self.endpoint.batcher.close()
