"""HTTP client of the ref server (ref_server/app.py), used by trainer ranks and genonly workers.

    client = RefClient("http://127.0.0.1:59875", token=os.environ.get("GRPO_REF_TOKEN"))
    client.wait_ready(timeout=300)
    client.upload(rollout_batch)           # -> batch id
    scored = client.get(timeout=5.0)       # -> ScoredBatch or None
    client.set_identity("worker0", "worker")   # named in the server's heartbeat table (GET /status)
    client.heartbeat("generating", rounds=3)   # alive while there is nothing to upload

Retry policy: an unreachable server (connection error, timeout, 502/504) is retried with
exponential backoff up to `max_retries` times in a row; a 503 means the server is alive and
applying backpressure (queue full, or shutting down), so it is retried after Retry-After
without limit - a producer simply waits for room. Other 4xx/5xx raise RefServerError at once.
Each outage is logged once, and its end once. Safe to share between threads.

Caveat: HTTP gives at-most-once on a lost response. If an upload's reply is lost the retry may
queue the batch twice; if a /get reply is lost that batch is gone. Both need the connection to
break mid-request.
"""
from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import requests
import urllib3

if TYPE_CHECKING:  # the batch codec imports torch: loaded by upload/get, not by `launch.sh status`'s table
    from common.wire.protocol import RolloutBatch, ScoredBatch

log = logging.getLogger("ref_client")


class RefServerError(RuntimeError):
    """The server refused a request (status = HTTP code), or could not be reached (status = 0)."""

    def __init__(self, status: int, message: str, url: str) -> None:
        what = f"answered {status}" if status else "unreachable"
        super().__init__(f"ref server {url} {what}: {message}")
        self.status, self.message, self.url = status, message, url


def _server_message(r: requests.Response) -> str:
    try:
        body = r.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])
    except ValueError:  # not JSON (e.g. waitress' own plain-text 4xx)
        pass
    return r.text.strip()[:300] or r.reason


def _retry_after(r: requests.Response) -> float | None:
    value = r.headers.get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), 60.0)  # capped: a bad header must not stall us for hours
    except ValueError:
        return None


class RefClient:
    def __init__(self, urls: str | Sequence[str], token: str | None = None, timeout: float = 30.0,
                 max_retries: int = 20, backoff: float = 0.5, backoff_max: float = 10.0) -> None:
        if isinstance(urls, str):
            urls = urls.split(",")
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("RefClient needs at least one server URL")
        self.token, self.timeout, self.max_retries = token, timeout, max_retries
        self.backoff, self.backoff_max = backoff, backoff_max
        self._lock = threading.Lock()
        self._local = threading.local()        # requests.Session is not thread-safe: one per thread
        self._sessions: list[requests.Session] = []
        self._rr_upload = self._rr_get = 0
        self._down_since: dict[str, float] = {}  # url -> when the current outage was first seen
        self._unreachable: set[str] = set()  # urls whose current outage included a connection failure
        self.outages = 0  # times a server became unreachable (not merely busy): what it held may be lost
        self.identity: dict[str, str] = {}  # X-GRPO-* headers naming this participant (set_identity)
        # While true, a failed request is not retried: a worker asked to stop (launch.sh stops the server too) must
        self.give_up: Callable[[], bool] = lambda: False  # not spend its last seconds in backoff against it

    def set_identity(self, participant_id: str, role: str, host: str | None = None) -> None:
        """Name this process in every request, for the server's heartbeat table (ref_server/status.py)."""
        self.identity.update({"X-GRPO-Id": participant_id, "X-GRPO-Role": role,
                              "X-GRPO-Host": host or socket.gethostname()})

    def set_version(self, version: int | None) -> None:
        """The policy version this participant is on (reported with each request)."""
        if version is None:
            self.identity.pop("X-GRPO-Version", None)
        else:
            self.identity["X-GRPO-Version"] = str(int(version))

    # -- plumbing -------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            if self.token:
                s.headers["Authorization"] = f"Bearer {self.token}"
            with self._lock:
                self._sessions.append(s)
        return s

    def _rotation(self, which: str) -> list[str]:
        """All URLs, starting at the next one in round-robin order for `which`."""
        with self._lock:
            k = getattr(self, which)
            setattr(self, which, k + 1)
        k %= len(self.urls)
        return self.urls[k:] + self.urls[:k]

    def _mark_down(self, url: str, problem: str, unreachable: bool = True) -> None:
        with self._lock:
            first = url not in self._down_since
            if first:
                self._down_since[url] = time.monotonic()
            if unreachable and url not in self._unreachable:
                self._unreachable.add(url)
                self.outages += 1
        if first:
            log.warning("ref server %s %s; retrying with backoff", url, problem)

    def _mark_up(self, url: str) -> None:
        with self._lock:
            since = self._down_since.pop(url, None)
            self._unreachable.discard(url)
        if since is not None:
            log.info("ref server %s is back after %.1f s", url, time.monotonic() - since)

    def _request(self, method: str, urls: list[str], path: str, retry: bool = True, read_timeout: float = 0.0,
                 **kw) -> tuple[str, requests.Response]:
        """Send to urls[0], moving on to the next URL after each retryable failure."""
        failures = attempt = 0
        if self.identity:
            kw["headers"] = {**self.identity, **kw.get("headers", {})}
        while True:
            url = urls[attempt % len(urls)]
            attempt += 1
            retry_after: float | None = None
            busy = False
            try:
                r = self._session().request(method, url + path, timeout=(min(self.timeout, 10.0),
                                                                         self.timeout + read_timeout), **kw)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                problem = f"unreachable ({type(e).__name__}: {e})"
                failures += 1
            else:
                if r.status_code == 503:
                    problem, retry_after, busy = f"busy ({_server_message(r)})", _retry_after(r), True
                elif r.status_code in (502, 504):
                    problem = f"answered {r.status_code} ({_server_message(r)})"
                    failures += 1
                elif r.status_code >= 400:
                    self._mark_up(url)
                    raise RefServerError(r.status_code, _server_message(r), url)
                else:
                    self._mark_up(url)
                    return url, r
            if not retry or self.give_up():
                raise RefServerError(0 if retry_after is None else 503, problem, url)
            if failures > self.max_retries:
                raise RefServerError(0, f"gave up after {self.max_retries} retries: {problem}", url)
            self._mark_down(url, problem, unreachable=not busy)
            delay = min(self.backoff * 2 ** max(failures - 1, 0), self.backoff_max)
            if retry_after is not None:  # the server said when: trust it
                delay = retry_after
            time.sleep(delay * random.uniform(0.9, 1.1))  # jitter: producers do not retry in lockstep

    # -- API ----------------------------------------------------------------------------
    def upload(self, batch: RolloutBatch) -> str:
        """Queue a rollout batch for scoring (round-robin over servers); returns its batch id."""
        from common.wire.protocol import CONTENT_TYPE, encode_rollout
        body = encode_rollout(batch)
        _, r = self._request("POST", self._rotation("_rr_upload"), "/upload", data=body,
                             headers={"Content-Type": CONTENT_TYPE})
        return str(r.json()["id"])

    def get(self, timeout: float = 0.0) -> ScoredBatch | None:
        """The oldest scored batch, waiting (long-poll) up to `timeout` seconds; None if none came."""
        from common.wire.protocol import decode_scored
        deadline = time.monotonic() + max(timeout, 0.0)
        first_pass = True
        while True:
            for url in self._rotation("_rr_get"):
                left = max(deadline - time.monotonic(), 0.0)
                # One server: long-poll it. Several: a quick look at each, then short polls in turn.
                wait = left if len(self.urls) == 1 else (0.0 if first_pass else min(left, 1.0))
                t0 = time.monotonic()
                _, r = self._request("GET", [url], "/get", params={"wait": f"{wait:.3f}"}, read_timeout=wait)
                if r.status_code == 200:
                    return decode_scored(r.content)
                if wait > 0 and time.monotonic() - t0 < wait / 2:  # server declined to hold the poll
                    time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
            first_pass = False
            if time.monotonic() >= deadline:
                return None

    def reward_scores(self, model: str, prompts: list, completions: list, timeout: float,
                      chat_template_kwargs: dict | None = None) -> list[float]:
        """The reward model `model` held by the server (ref_server/reward_models.py) scores these completions;
        `timeout`: seconds the scoring may take (a round's groups, beyond the usual request timeout);
        chat_template_kwargs: the run's, for the reward tokenizer's chat template (TRL's)."""
        body = {"model": model, "prompts": prompts, "completions": completions}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        # no retry: past `timeout` the model is too slow (or stuck), which the run must hear about, not wait out
        _, r = self._request("POST", self._rotation("_rr_upload"), "/reward", retry=False, read_timeout=timeout,
                             json=body)
        return [float(v) for v in r.json()["rewards"]]

    # -- policy weights (ref_server/weights.py): rank 0 publishes, workers follow -------------
    def publish_weights(self, blob, version: int) -> None:
        """PUT the policy's safetensors bytes as `version` on every server (workers may use any).

        `blob`: bytes, or a re-iterable of pieces with a len() (common.weights.blob.ParametersBody)."""
        for url in self.urls:
            self._request("PUT", [url], "/weights", params={"version": str(version)}, data=blob,
                          headers={"Content-Type": "application/octet-stream"}, read_timeout=len(blob) / 50e6)

    def weights_version(self) -> int | None:
        """The newest published policy version on the first server, or None before any publish."""
        _, r = self._request("GET", self.urls[:1], "/weights/version")
        v = r.json().get("version")
        return None if v is None else int(v)

    def weights_info(self) -> dict:
        """GET /weights/version of the first server: version, sizes and the bytes served to workers so far."""
        _, r = self._request("GET", self.urls[:1], "/weights/version")
        return r.json()

    def fetch_weights(self, since: int | None = None) -> tuple[int, bytearray]:
        """(version, safetensors blob) of the newest published policy weights; with `since` (the version
        this process holds), the server sends a delta from it instead when it has one (common/weights/delta.py).

        The read timeout is per socket read (self.timeout): a body that stops arriving mid-way, or a
        connection cut short, raises RefServerError (status 0) at once, never a half-read blob."""
        _, r = self._request("GET", self.urls[:1], "/weights", stream=True,
                             params={} if since is None else {"since": str(since)})
        # Into one preallocated buffer (requests' .content joins small chunks), 16 MB a read:
        # urllib3's readinto reads the whole requested size into a temporary first.
        with r:
            size = int(r.headers["Content-Length"])
            buf, got = bytearray(size), 0
            view = memoryview(buf)
            while got < size:
                try:
                    n = r.raw.readinto(view[got:got + (16 << 20)])
                except (OSError, urllib3.exceptions.HTTPError) as e:  # stalled (read timeout) or reset mid-body
                    raise RefServerError(0, f"weights download broke at {got} of {size} bytes "
                                            f"({type(e).__name__}: {e})", self.urls[0]) from None
                if not n:
                    raise RefServerError(0, f"weights download cut off at {got} of {size} bytes", self.urls[0])
                got += n
        return int(r.headers["X-Policy-Version"]), buf

    def health(self, url: str | None = None, retry: bool = False) -> dict:
        """GET /health of one server (default: the first): one attempt, or with the retry policy if `retry`."""
        _, r = self._request("GET", [url or self.urls[0]], "/health", retry=retry)
        return r.json()

    def stats(self, url: str | None = None) -> dict:
        """GET /stats of one server (default: the first), one attempt."""
        _, r = self._request("GET", [url or self.urls[0]], "/stats", retry=False)
        return r.json()

    def heartbeat(self, state: str, **counts: int) -> None:
        """POST /heartbeat to every server: alive, doing `state`, with cumulative counters. One attempt each."""
        for url in self.urls:
            self._request("POST", [url], "/heartbeat", retry=False, json={"state": state, **counts})

    def status(self, url: str | None = None, stall_warn: float | None = None, timeout: float | None = None) -> dict:
        """GET /status of one server (default: the first), one attempt; `timeout` bounds it (seconds)."""
        params = {} if stall_warn is None else {"stall_warn": str(stall_warn)}
        target = (url or self.urls[0]) + "/status"
        try:
            r = self._session().get(target, params=params, timeout=timeout or self.timeout)
        except requests.RequestException as e:
            raise RefServerError(0, f"{type(e).__name__}: {e}", url or self.urls[0]) from None
        if r.status_code != 200:
            raise RefServerError(r.status_code, _server_message(r), url or self.urls[0])
        return r.json()

    def wait_ready(self, timeout: float = 60.0, poll: float = 0.5) -> list[dict]:
        """Poll /health of every server until each says "ok"; returns their health dicts in URL order."""
        deadline = time.monotonic() + timeout
        ready: dict[str, dict] = {}
        last_problem, logged = "", False
        while True:
            for url in self.urls:
                if url in ready:
                    continue
                try:
                    h = self.health(url)
                except RefServerError as e:
                    if e.status not in (0, 503):  # a real refusal (e.g. 404: not a ref server) will not heal
                        raise
                    last_problem = str(e)
                    continue
                if h.get("status") == "ok":
                    ready[url] = h
                else:
                    last_problem = f"ref server {url} status {h.get('status')!r}"
            if len(ready) == len(self.urls):
                if logged:
                    log.info("ref server(s) ready")
                return [ready[u] for u in self.urls]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ref server(s) not ready after {timeout:.0f} s: {last_problem}")
            if not logged:
                log.info("waiting for ref server(s) %s", ", ".join(u for u in self.urls if u not in ready))
                logged = True
            time.sleep(poll)

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for s in sessions:
            s.close()

    def __enter__(self) -> RefClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
