"""Nothing before the token (issue 23): a request without the bearer token gets its 401 from the headers;
the server allocates, buffers and spools nothing for its body. Bodies over a path's limit likewise (413),
chunked ones included, before the body ends.

A real ref server process with a token and a 16 GiB weights limit (--max-weights-mb 16384, the size a 3B model
gets by default; the tiny model's own default is ~70 MiB), so a multi-GiB declaration is within the limit and
only the token stands in the way; its resident memory is read with psutil.
"""
from __future__ import annotations

import select
import socket
import time

import psutil
import pytest
import requests
from conftest import start_ref_server, subprocess_env

TOKEN = "preauth-token-0a1b2c3d4e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GIB = 1 << 30


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text(TOKEN)
    with start_ref_server(tiny_model_dir, "--token-file", str(token_file), "--max-body-mb", "1",
                          "--max-weights-mb", "16384", "--device", "cpu", env=subprocess_env(GRPO_REF_TOKEN="")) as srv:
        yield srv


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _spooled_files(pid: int) -> list[str]:
    """Unlinked temp files the server holds open (waitress spools request bodies to such files)."""
    return [f.path for f in psutil.Process(pid).open_files() if f.path.endswith("(deleted)") or "/#" in f.path]


def _head(method: str, target: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends on `s` until it closes (or `timeout` passes)."""
    s.settimeout(timeout)
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


def _send_until_answered(s: socket.socket, pieces) -> int:
    """Send body pieces one by one, stopping as soon as the server answers (or closes); returns pieces sent."""
    sent = 0
    for piece in pieces:
        if select.select([s], [], [], 0.05)[0]:
            break
        try:
            s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            break
        sent += 1
    return sent


BAD_AUTH = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]


def test_declared_bodies_without_token_allocate_nothing(server):
    """Header-only PUT /weights declaring 3 GiB each (the pre-fix parser preallocated them) and POST /upload
    under its limit: 401 at once, resident memory within a few MB, no temp file, server healthy."""
    pid = server.proc.pid
    requests.get(server.url + "/health", timeout=10)
    before = _rss_mb(pid)
    socks, answers = [], []
    try:
        for i, bad in enumerate(BAD_AUTH * 2):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            socks.append(s)  # kept open: the server must not be waiting on these bodies either
            if i % 2 == 0:
                s.sendall(_head("PUT", f"/weights?version={i + 1}", {**bad, "Content-Length": str(3 * GIB)}))
            else:
                s.sendall(_head("POST", "/upload", {**bad, "Content-Length": str(1 << 20)}) + b"\0" * 4096)
        answers = [_answer(s, 20) for s in socks]
        peak, spooled = _rss_mb(pid), _spooled_files(pid)
    finally:
        for s in socks:
            s.close()
    for a in answers:
        assert a.startswith(b"HTTP/1.1 401"), a[:200]
        assert b"token" in a
    print(f"RSS {before:.1f} MB -> {peak:.1f} MB after {len(socks)} unauthenticated declarations "
          f"(3 x {3 * GIB} bytes to PUT /weights)")
    assert peak - before < 8, (before, peak)
    assert not spooled, spooled
    h = requests.get(server.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and server.proc.poll() is None


def test_chunked_upload_without_token_answered_before_its_end(server):
    """A chunked body that never ends, no token: 401 while it is still being sent; nothing spooled."""
    pid = server.proc.pid
    before = _rss_mb(pid)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_head("POST", "/upload", {"Transfer-Encoding": "chunked"}))
        chunk = b"%x\r\n" % (64 << 10) + b"\1" * (64 << 10) + b"\r\n"
        sent = _send_until_answered(s, [chunk] * 64)  # up to 4 MiB of a body that never ends
        answer = _answer(s, 20)
        assert _spooled_files(pid) == []
    assert answer.startswith(b"HTTP/1.1 401"), (sent, answer[:200])
    print(f"401 after {sent} x 64 KiB chunks sent")
    assert _rss_mb(pid) - before < 8
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_chunked_upload_over_limit_is_413_before_its_end(server):
    """With the token: a chunked body past --max-body-mb (1 MiB) is cut off there with the JSON 413."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_head("POST", "/upload", {**AUTH, "Transfer-Encoding": "chunked"}))
        chunk = b"%x\r\n" % (256 << 10) + b"\1" * (256 << 10) + b"\r\n"
        sent = _send_until_answered(s, [chunk] * 64)  # up to 16 MiB offered, never terminated
        answer = _answer(s, 20)
    assert answer.startswith(b"HTTP/1.1 413"), (sent, answer[:200])
    assert sent < 64, sent  # answered before the body's end, not after spooling it all
    assert b'"error"' in answer and b"limit" in answer
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_authorized_weights_publish_still_works(server):
    """The gate lets the real thing through: an authorized PUT /weights is received and relayed."""
    import torch
    from safetensors.torch import save
    blob = save({"w": torch.arange(1000, dtype=torch.float32)})
    r = requests.put(server.url + "/weights?version=1", data=blob, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    got = requests.get(server.url + "/weights", headers=AUTH, timeout=30)
    assert got.content == blob and got.headers["X-Policy-Version"] == "1"
