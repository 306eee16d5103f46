"""HTTP side of the ref server: the Bottle app (ref_server/serve.py runs it under waitress, several threads).
Its state and the /status and /health views: ref_server/state.py; the token check: ref_server/auth.py.

    POST /upload   rollout message (common/wire/protocol.py) -> 202 {"id", "queued"}
    GET  /get      oldest scored message (FIFO, each handed out once); 204 when none; ?wait=S long-polls
    POST /reward   {"model", "prompts", "completions"} -> {"rewards"}: the reward models (ref_server/reward_models.py)
    GET  /health   status, model, vocab size, max_seq_len, dtype, device, queue depths, uptime
    GET  /stats    JSON counters;   GET /metrics   Prometheus text
    GET  /status   heartbeat table, queues, weight version (ref_server/status.py);  GET /  the same as HTML
    POST /heartbeat  a participant says it is alive (JSON body: state and cumulative counters)

Every error is JSON {"error": "..."}; client input never causes a 5xx.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import bottle
import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.modeling import load_model
from common.wire.protocol import CONTENT_TYPE, ProtocolError, decode_rollout
from ref_server.auth import _authorized, _query_token_ok
from ref_server.config import ServerConfig, resolve_token
from ref_server.reward_models import RewardModels, add_routes
from ref_server.scorer import QueueFull, Scorer, ServerMetrics, Stopping
from ref_server.state import ServerState
from ref_server.status import identity_from_environ, render_html
from ref_server.weights import StaleBase, WeightError
from ref_server.weights_limit import weights_limit

log = logging.getLogger("ref_server")
JSON = "application/json"


def _error(status: int, message: str, **headers: str) -> bottle.HTTPResponse:
    return bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                               headers={"Content-Type": JSON, **headers})


def _json(obj: dict, status: int = 200) -> bottle.HTTPResponse:
    return bottle.HTTPResponse(json.dumps(obj), status=status, headers={"Content-Type": JSON})




def _query_seconds(name: str, default: float) -> float:
    """A query parameter in seconds (finite, >= 0); absent = default; anything else is a 400."""
    raw = bottle.request.query.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _error(400, f"{name} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise _error(400, f"{name} must be a finite number >= 0, got {raw!r}")
    return value


def make_app(cfg: ServerConfig, model: torch.nn.Module | None = None,
             token: str | None = None) -> tuple[bottle.Bottle, ServerState]:
    """Build the WSGI app and its state, loading the model unless one is given; starts the scorer thread.

    `token` defaults to resolve_token(cfg) (--token-file, then $GRPO_REF_TOKEN).
    """
    token = resolve_token(cfg) if token is None else token
    if model is None:
        t0 = time.time()
        model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, options=cfg.load_options())
        p = next(model.parameters())
        log.info("model %s loaded in %.1f s (%.1fM params, %s on %s)", cfg.model, time.time() - t0,
                 sum(q.numel() for q in model.parameters()) / 1e6, str(p.dtype).replace("torch.", ""), p.device)
    model.eval().requires_grad_(False)
    ref_p = next(model.parameters())  # reward models (TRL reward_funcs entries) live beside it, same device/dtype
    rewards = RewardModels.load(cfg.reward_models, ref_p.device, ref_p.dtype, cfg.load_options(),
                                cfg.score_token_budget) if cfg.reward_models else None
    metrics = ServerMetrics()
    scorer = Scorer(model, metrics, cfg.max_queue, cfg.max_output_queue, cfg.score_token_budget, cfg.chunk_tokens,
                    padding_free=cfg.padding_free)
    state = ServerState(cfg=cfg, model=model, scorer=scorer, metrics=metrics, token=token,
                        vocab_size=int(model.get_input_embeddings().num_embeddings),
                        max_seq_len=int(model.config.max_position_embeddings),
                        long_polls=threading.BoundedSemaphore(max(1, cfg.threads // 2)),
                        weights_limit=weights_limit(cfg.max_weights_mb, model),
                        placement=json.loads(Path(cfg.placement_file).read_text()) if cfg.placement_file else None)
    log.info("policy weights publishes (PUT /weights) up to %s MiB (%s)", f"{state.weights_limit.mb:,.0f}",
             state.weights_limit.how)
    app = bottle.Bottle(catchall=True)
    retry = {"Retry-After": str(cfg.retry_after)}

    def reject(reason: str, status: int, message: str, **headers: str) -> bottle.HTTPResponse:
        metrics.on_reject(reason)
        return _error(status, message, **headers)

    def require_token(query_ok: bool = False) -> None:
        env = bottle.request.environ
        if not (_authorized(state.token, env) or (query_ok and _query_token_ok(state.token, env))):
            raise reject("unauthorized", 401, "missing or wrong bearer token", **{"WWW-Authenticate": "Bearer"})

    @app.post("/upload")
    def upload():
        if state.stopping:
            raise reject("stopping", 503, "server is shutting down", **retry)
        require_token()
        env = bottle.request.environ
        # waitress de-chunks bodies (and caps them at max_request_body_size) before we run,
        # so a missing CONTENT_LENGTH here means the client sent no length at all.
        raw_len = env.get("CONTENT_LENGTH", "")
        if not raw_len:
            raise reject("length_required", 411, "Content-Length header required")
        try:
            length = int(raw_len)
        except ValueError:
            raise reject("bad_request", 400, f"bad Content-Length {raw_len!r}") from None
        limit = cfg.max_body_bytes
        if length > limit:  # decided from the header: the body is not read
            raise reject("too_large", 413, f"body of {length} bytes exceeds the limit of {limit} bytes")
        if scorer.full():  # cheap early answer; submit() re-checks under the lock
            raise reject("queue_full", 503, "input queue full, retry later", **retry)
        stream, chunks, got = env["wsgi.input"], [], 0
        while got < length:
            piece = stream.read(min(length - got, limit + 1 - got))
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
        if got != length:
            raise reject("bad_request", 400, f"body has {got} bytes, Content-Length says {length}")
        try:
            rb = decode_rollout(b"".join(chunks), vocab_size=state.vocab_size, max_seq_len=state.max_seq_len)
        except ProtocolError as e:
            raise reject("bad_request", 400, f"invalid rollout message: {e}") from None
        if not rb.batch_id:
            raise reject("bad_request", 400, "invalid rollout message: empty batch_id")
        try:
            depth = scorer.submit(rb)
        except QueueFull:
            raise reject("queue_full", 503, "input queue full, retry later", **retry) from None
        except Stopping:
            raise reject("stopping", 503, "server is shutting down", **retry) from None
        metrics.on_accept()
        state.heartbeats.on_upload(identity_from_environ(env))
        return _json({"id": rb.batch_id, "queued": depth}, status=202)

    @app.get("/get")
    def get():
        require_token()
        wait = min(_query_seconds("wait", 0.0), cfg.max_get_wait)
        body = scorer.take(0.0)
        # Long-poll only while a waitress thread stays free for uploads; otherwise answer now.
        if body is None and wait > 0 and state.long_polls.acquire(blocking=False):
            try:
                body = scorer.take(wait)
            finally:
                state.long_polls.release()
        state.heartbeats.on_get(identity_from_environ(bottle.request.environ), taken=body is not None)
        if body is None:
            return bottle.HTTPResponse(status=204)
        return bottle.HTTPResponse(body, status=200, headers={"Content-Type": CONTENT_TYPE})

    @app.put("/weights")
    def put_weights():
        require_token()
        raw = bottle.request.query.get("version", "")
        if not raw.isdigit():
            raise _error(400, f"version must be a non-negative integer, got {raw!r}")
        env = bottle.request.environ
        try:
            length = int(env.get("CONTENT_LENGTH") or "")
        except ValueError:
            raise _error(411, "Content-Length header required") from None
        if length > state.weights_limit.bytes:  # one line naming the limit and the knob (the trainer repeats it)
            raise _error(413, state.weights_limit.refusal(length))
        buf = getattr(env["wsgi.input"], "body", None)  # received into one bytearray by our channel (no copy)
        if buf is None:  # another WSGI server: one preallocated copy, filled from the request stream
            buf = state.weights.buffer(length)
            got = 0
            while got < length:
                piece = env["wsgi.input"].read(min(length - got, 8 << 20))
                if not piece:
                    break
                buf[got:got + len(piece)] = piece
                got += len(piece)
        got = len(buf)
        if got != length:
            raise _error(400, f"body has {got} bytes, Content-Length says {length}")
        try:
            state.weights.publish(int(raw), buf)
        except WeightError as e:
            raise _error(409 if isinstance(e, StaleBase) or "not newer" in str(e) else 400, str(e)) from None
        return _json({"version": int(raw), "bytes": length})

    @app.get("/weights/version")
    def weights_version():
        require_token()
        return _json(state.weights.info())

    @app.get("/weights")
    def get_weights():
        require_token()
        since = bottle.request.query.get("since", "")
        if since and not since.isdigit():
            raise _error(400, f"since must be a non-negative integer, got {since!r}")
        version, reader, kind = state.weights.open_latest(int(since) if since else None)
        if reader is None:
            raise _error(404, "no policy weights published yet")
        return bottle.HTTPResponse(reader, status=200, headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(len(reader.blob)),
            "X-Policy-Version": str(version), "X-Weights-Format": kind})

    @app.get("/health")
    def health():
        return _json(state.health())

    @app.get("/stats")
    def stats():
        require_token()
        return _json({**metrics.snapshot(), "queues": scorer.depths(), "stopping": state.stopping})

    def stall_warn_param() -> float:
        return _query_seconds("stall_warn", cfg.stall_warn)

    @app.get("/status")
    def status():
        require_token(query_ok=True)
        return _json(state.status(stall_warn_param()))

    @app.get("/")
    def status_page():
        require_token(query_ok=True)
        return bottle.HTTPResponse(render_html(state.status(stall_warn_param())),
                                   headers={"Content-Type": "text/html; charset=utf-8"})

    @app.post("/heartbeat")
    def heartbeat():
        require_token()
        ident = identity_from_environ(bottle.request.environ)
        if ident is None:
            raise _error(400, "heartbeat needs an X-GRPO-Id header")
        try:
            body = json.loads(bottle.request.body.read(1 << 16) or b"{}")
        except (ValueError, RecursionError):
            raise _error(400, "heartbeat body must be a JSON object") from None
        if not isinstance(body, dict):
            raise _error(400, "heartbeat body must be a JSON object")
        state.heartbeats.on_heartbeat(ident, body)
        return _json({"ok": True})

    @app.get("/metrics")
    def prom():
        require_token()
        return bottle.HTTPResponse(generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def json_error(res: bottle.HTTPError) -> bytes:
        # Bottle's own errors (404, 405, uncaught exceptions): JSON, never an HTML page or a traceback.
        bottle.response.content_type = JSON
        if res.status_code >= 500:
            log.error("internal error on %s %s: %s", bottle.request.method, bottle.request.path, res.exception)
            return json.dumps({"error": "internal server error"}).encode()
        return json.dumps({"error": f"{res.status_line}: {res.body}"}).encode()

    if rewards is not None:
        add_routes(app, rewards, require_token, _error, _json, cfg.max_body_bytes)
    app.default_error_handler = json_error  # type: ignore[method-assign]
    scorer.start()
    return app, state
