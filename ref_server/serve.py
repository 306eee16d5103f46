"""The ref server process: waitress serving the Bottle app (ref_server/app.py) on a socket bound before the
model loads, the token and per-path body limits applied from the headers (ref_server/gate.py), and a clean
SIGTERM/SIGINT shutdown that delivers what is already scored."""
from __future__ import annotations

import logging
import math
import signal
import threading
import time

from common.listen import listen_socket
from ref_server.app import make_app
from ref_server.config import ServerConfig, check_bind, resolve_token
from ref_server.gate import make_channel
from ref_server.reward_models import RewardModelError

log = logging.getLogger("ref_server")


class _Throttle(logging.Filter):
    """Let one record through per `every` seconds (waitress logs queue depth per request under load)."""

    def __init__(self, every: float) -> None:
        super().__init__()
        self.every, self.last = every, -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < self.every:
            return False
        self.last = now
        return True


def serve(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT: stop taking uploads, finish the forward in progress, return 0."""
    from waitress import create_server

    token = resolve_token(cfg)
    check_bind(cfg, token)
    stop, signals = threading.Event(), []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)  # a second signal skips the drain wait below
        stop.set()

    try:  # the port first: a port held by another run fails here at once, before the (slow) model load
        sock = listen_socket(cfg.host, cfg.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s (another server holds the port? pick a free --port)",
                  cfg.host, cfg.port, e)
        return 1
    # Installed before the (slow) model load, so an early SIGTERM also ends in a clean exit 0.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        app, state = make_app(cfg, token=token)
    except RewardModelError as e:  # one line naming the model; launch.sh shows it and stops the run
        log.error("%s", e)
        sock.close()
        return 1
    logging.getLogger("waitress.queue").addFilter(_Throttle(60.0))
    try:
        server = create_server(app, sockets=[sock], threads=cfg.threads, ident="grpo-ref-server",
                               # waitress buffers a body before the app sees it: cap that too. Slack so
                               # that a modest overshoot still gets our JSON 413 (decided from the header).
                               max_request_body_size=max(cfg.max_body_bytes, state.weights_limit.bytes) + (1 << 20),
                               channel_timeout=max(120, int(cfg.max_get_wait) + 30),
                               # big socket reads/writes: weight blobs are hundreds of MB (defaults: 8 KB / 18 KB)
                               recv_bytes=1 << 18, send_bytes=1 << 18,
                               # responses stay in memory (bounded by outbuf_high_watermark) instead of
                               # being spooled to a temp file at 1 MB
                               outbuf_overflow=64 << 20, outbuf_high_watermark=32 << 20)
    except OSError as e:  # port taken, address not local...
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, e)
        state.scorer.stop()
        return 1
    # the token and the body limits, applied at the header: nothing allocated or spooled for a stranger
    server.channel_class = make_channel(cfg, token, state.weights, state.weights_limit.bytes)
    threading.Thread(target=server.run, name="http", daemon=True).start()
    log.info("serving %s on http://%s:%s (vocab %d, max_seq_len %d, token %s, %d threads)", cfg.model, cfg.host,
             server.effective_port, state.vocab_size, state.max_seq_len, "required" if token else "off", cfg.threads)
    while not stop.wait(0.5):
        pass
    log.info("shutdown requested: refusing uploads, finishing the batch being scored")
    state.stopping = True
    state.scorer.stop()
    # Scored work is still worth delivering: keep answering /get for a while (until a second signal).
    deadline = time.monotonic() + cfg.drain_timeout
    while state.scorer.depths()["output"] and time.monotonic() < deadline and len(signals) < 2:
        time.sleep(0.1)
    left = state.scorer.depths()["output"]
    if left:
        log.warning("exiting with %d scored batch(es) not fetched", left)
    stop_http(server)
    log.info("ref server stopped")
    return 0


def stop_http(server) -> None:
    """Stop waitress: its request threads first, each finishing the request it serves (up to 2 s), then its sockets
    and trigger pipe. The other way round, a request that finished after close() pulled the trigger on the closed
    pipe (EBADF, a traceback in ref_server.log: a reward-model run in a CI-like suite run, 2026-11-29). A request
    still running past 2 s keeps them open: the process's exit, right after, closes them."""
    server.task_dispatcher.shutdown(timeout=2)
    if not server.task_dispatcher.threads:
        server.close()
