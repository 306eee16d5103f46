"""Bad input: thousands of malformed requests (seeded, reproducible) against a real ref server.

No 5xx, no crash, no worker thread lost; /health answers and a valid upload round-trips afterwards.
Raw sockets for what http clients cannot send (lying Content-Length, broken framing, odd bytes).
The trainer side of bad input (what /get hands back) is tests/test_scored_validation.py; the malformed bodies
are built by tests/fuzz_messages.py.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch
from conftest import start_ref_server
from fuzz_messages import framing_bad, semantic_bad, st_blob
from test_ref_server import make_batch

from common.wire.protocol import decode_scored, encode_rollout

SEED = 20240607
N_CASES = 2400
BODY_LIMIT = 1 << 20  # --max-body-mb 1
WEIGHTS_LIMIT = 2 << 20  # --max-weights-mb 2

# --------------------------------------------------------------------------- raw HTTP
def raw_exchange(port: int, data: bytes, half_close: bool, timeout: float = 15.0) -> tuple[int | None, bool]:
    """Send bytes, read until the server closes. Returns (first status or None, timed_out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # broken pipe, reset, or not connected: the server may answer from the headers and close
            pass
        s.settimeout(timeout)
        got, timed_out = b"", False
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            timed_out = True
        except ConnectionResetError:
            pass
    # the final status: skip interim 1xx answers (100 Continue)
    for line in got.split(b"\r\n"):
        if line[:5] == b"HTTP/" and line[9:12].isdigit() and line[9:10] != b"1":
            return int(line[9:12]), timed_out
    return None, timed_out


def raw_case(rng: random.Random) -> tuple[bytes, bool]:
    """(request bytes, half_close): requests no http client would send."""
    kind = rng.randrange(14)
    body = encode_rollout(make_batch([3], [3], seed=rng.randrange(1000)))
    if kind == 0:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 3000))), True
    if kind == 1:  # truncated request (line, headers or body), then EOF
        full = (b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        return full[:rng.randrange(1, len(full))], True
    if kind == 2:  # Content-Length larger than the body (a lie), then EOF
        return (b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body) + rng.randint(1, 5000)).encode()
                + b"\r\n\r\n" + body), True
    if kind == 3:  # Content-Length smaller than the body: the rest is garbage as a next request
        cut = rng.randrange(0, len(body))
        return (b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(cut).encode() + b"\r\n\r\n" + body
                + b"\r\n\r\n"), True
    if kind == 4:  # malformed Content-Length values
        cl = rng.choice([b"abc", b"-5", b"1 2", b"0x10", b"1e3", b"", b"+5", b"99999999999999999999999",
                         b"5, 6", b"\xff\xfe"])
        return b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: " + cl + b"\r\nConnection: close\r\n\r\n", True
    if kind == 5:  # two different Content-Length headers
        return (b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + body), True
    if kind == 6:  # over the body limit, declared (tiny body) or huge
        cl = rng.choice([BODY_LIMIT + 1, 10 * BODY_LIMIT, 2**40, 2**62])
        path = rng.choice([b"/upload", b"/weights?version=7", b"/get", b"/nope"])
        meth = rng.choice([b"POST", b"PUT"])
        return meth + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(cl).encode() + b"\r\n\r\nab", True
    if kind == 7:  # chunked: broken chunk sizes / garbage
        chunks = rng.choice([b"zz\r\nabc\r\n0\r\n\r\n", b"5\r\nab\r\n", b"-1\r\n\r\n", b"ffffffffffffffff\r\nab",
                             b"3\r\nabc\r\n0\r\n\r\n", hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"])
        return b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks, True
    if kind == 8:  # unsupported transfer encodings
        te = rng.choice([b"gzip", b"chunked, gzip", b"identity", b"\xff", b"chunked\x00"])
        return (b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te + b"\r\nConnection: close\r\n\r\n"
                + body), True
    if kind == 9:  # header syntax damage and non-latin bytes
        line = rng.choice([b"NoColonHere", b": empty-name", b"X-\xff\xfe: \x00\x01", b"Bad Header: x",
                           b" folded continuation", b"X-A:\r", b"Authorization: Bearer \xe9\xff"])
        return b"GET /health HTTP/1.1\r\nHost: x\r\n" + line + b"\r\nConnection: close\r\n\r\n", True
    if kind == 10:  # oversized headers
        return b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * rng.choice([300_000, 70_000]) + b"\r\n\r\n", True
    if kind == 11:  # odd methods, versions and request lines
        line = rng.choice([b"FOO /health HTTP/1.1", b"get /health HTTP/1.1", b"GET /health HTTP/2.0",
                           b"GET /health HTTP/9.9", b"GET /health", b"GET", b"/health", b"GET  /health  HTTP/1.1",
                           b"GET http://evil/health HTTP/1.1", b"GET *", b"CONNECT 127.0.0.1:1 HTTP/1.1",
                           b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])
        return line + b"\r\nHost: x\r\nConnection: close\r\n\r\n", True
    if kind == 12:  # Expect: 100-continue and then no (or a wrong) body
        return (b"POST /upload HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n"
                + rng.choice([b"", b"0123456789"])), True
    # odd bytes in path and query
    target = rng.choice([b"/\xe9\xff", b"/get?wait=\xe9", b"/%00", b"/../../etc/passwd", b"/get?%zz=1",
                         b"/get?wait=1&wait=abc", b"//get", b"/get#frag", b"/" + b"a" * 8000, b"/get?" + b"&" * 5000])
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", True


def http_case(rng: random.Random) -> tuple[str, str, dict, bytes | None]:
    """(method, path with query, headers, body) for requests: bodies and queries that are wrong."""
    kind = rng.randrange(9)
    ct = {"Content-Type": rng.choice(["application/vnd.grpo.safetensors", "text/plain", "application/json", ""])}
    if kind in (0, 1):
        return "POST", "/upload", ct, semantic_bad(rng)
    if kind in (2, 3):
        return "POST", "/upload", ct, framing_bad(rng)
    if kind == 4:  # random bytes
        return "POST", "/upload", ct, bytes(rng.randrange(256) for _ in range(rng.randint(0, 4000)))
    if kind == 5:  # bad query strings
        wait = rng.choice(["abc", "-1", "nan", "-inf", "inf", "1e309", "", "0x1", "1" * 400, "%00", "1,5", "\u00e9",
                           "0.01", "1e-300", "-0"])
        return "GET", "/get?wait=" + requests.utils.quote(wait, safe="%"), {}, None
    if kind == 6:  # unknown paths and methods
        method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"])
        path = rng.choice(["/", "/nope", "/upload/x", "/get/", "/health/../stats", "/weights/version/x", "/UPLOAD",
                           "/%2e%2e/", "/" + "".join(rng.choice("abc/%._-") for _ in range(rng.randint(1, 40)))])
        return method, path, {}, rng.choice([None, b"x" * rng.randint(0, 100)])
    if kind == 7:  # PUT /weights garbage (body and version)
        version = rng.choice(["1", "-1", "abc", "", "1.5", "9" * 40, "1e3", "00"])
        body = rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(0, 2000))), framing_bad(rng),
                           st_blob({}, {"a": "b"}), b"{}", b""])
        return "PUT", f"/weights?version={version}", {"Content-Type": "application/octet-stream"}, body
    # oversized real body (a few: they cost a MiB each)
    if rng.random() < 0.1:
        return "POST", "/upload", ct, b"\0" * (BODY_LIMIT + rng.randint(1, 1000))
    return "GET", rng.choice(["/weights", "/weights/version", "/stats", "/health", "/metrics"]), {}, None


# --------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    with start_ref_server(tiny_model_dir, "--max-body-mb", "1", "--max-weights-mb", "2", "--device", "cpu",
                          "--drain-timeout", "0") as srv:
        yield srv


def _worker_threads(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def test_fuzz_no_5xx_no_crash(fuzz_server):
    srv = fuzz_server
    rng = random.Random(SEED)
    cases = []
    for _ in range(N_CASES):
        if rng.random() < 0.4:
            cases.append(("raw", raw_case(rng)))
        else:
            cases.append(("http", http_case(rng)))
    threads_before = _worker_threads(srv.proc.pid)
    statuses: Counter = Counter()
    by_kind: Counter = Counter()
    timeouts: list = []
    session_local = threading.local()

    def run(case) -> None:
        kind, spec = case
        if kind == "raw":
            data, half = spec
            status, timed_out = raw_exchange(srv.port, data, half)
            if timed_out:
                timeouts.append(data[:120])
            statuses[status if status is not None else "closed"] += 1
        else:
            method, path, headers, body = spec
            s = getattr(session_local, "s", None) or requests.Session()
            session_local.s = s
            try:
                r = s.request(method, srv.url + path, data=body, headers=headers, timeout=30)
                statuses[r.status_code] += 1
                if r.status_code >= 400 and method != "HEAD":
                    assert r.headers.get("Content-Type", "").startswith(("application/json", "text/plain")), r.headers
            except requests.ConnectionError:  # e.g. the server closed after an early 413 mid-body: allowed
                statuses["reset"] += 1
                session_local.s = None
        by_kind[kind] += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, cases))
    seconds = time.monotonic() - t0
    print(f"\nfuzz: {sum(by_kind.values())} malformed requests ({dict(by_kind)}) in {seconds:.1f} s; "
          f"statuses {dict(sorted(statuses.items(), key=str))}")
    assert sum(by_kind.values()) >= 2000
    assert srv.proc.poll() is None, "server died"
    assert not [k for k in statuses if isinstance(k, int) and k >= 500], statuses
    assert not timeouts, timeouts[:5]  # every malformed request was answered or closed promptly
    assert statuses[400] > 500 and statuses[413] > 0 and statuses[404] > 0 and statuses[405] > 0

    # Still whole: same threads, /health, 8 concurrent requests, a valid upload round-trips.
    assert _worker_threads(srv.proc.pid) == threads_before
    assert requests.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: requests.get(srv.url + ("/get?wait=0.5" if i % 2 else "/health"),
                                                       timeout=30).status_code, range(8)))
    assert all(a in (200, 204) for a in answers), answers
    b = make_batch([4, 5], [3, 6], seed=77, producer_id="after-fuzz")
    r = requests.post(srv.url + "/upload", data=encode_rollout(b), timeout=30)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    got = None
    while time.monotonic() < deadline:  # anything valid the fuzzer happened to send comes first (FIFO)
        r = requests.get(srv.url + "/get?wait=2", timeout=30)
        if r.status_code == 200:
            s = decode_scored(r.content)
            if s.batch_id == b.batch_id:
                got = s
                break
    assert got is not None and torch.equal(got.input_ids, b.input_ids) and got.ref_logps.shape == (2, 6)
    st = requests.get(srv.url + "/stats", timeout=10).json()
    assert st["scoring_errors"] == 0, st
    log = srv.log()
    assert "internal error" not in log and "Traceback" not in log and "Exception while serving" not in log, log[-3000:]
