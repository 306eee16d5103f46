"""Access: loopback by default, a token on every endpoint but /health, no public bind without a token
unless --insecure, the body limit decided from the header, and no unpickling of network data anywhere.

Real ref server processes on 127.0.0.1 (a 0.0.0.0 bind is only ever talked to through 127.0.0.1).
"""
from __future__ import annotations

import ast
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests
import torch
from conftest import REPO, find_free_port, start_ref_server, subprocess_env
from test_ref_server import make_batch

from common.wire.protocol import encode_rollout
from ref_server.config import ServerConfig

TOKEN = "access-token-9f8e7d6c5b4a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _listen_addresses(pid: int, port: int) -> set[str]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _read_response(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (or `timeout` passes)."""
    s.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def public_server(tiny_model_dir, tmp_path_factory):
    """Bound to 0.0.0.0 with a token (allowed), small body and weights limits."""
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text(TOKEN + "\n")
    with start_ref_server(tiny_model_dir, "--host", "0.0.0.0", "--token-file", str(token_file),
                          "--max-body-mb", "1", "--max-weights-mb", "2", "--device", "cpu",
                          env=subprocess_env(GRPO_REF_TOKEN="")) as srv:
        yield srv


def test_default_bind_is_loopback(tiny_model_dir):
    assert ServerConfig().host == "127.0.0.1"
    with start_ref_server(tiny_model_dir, env=subprocess_env(GRPO_REF_TOKEN="")) as srv:
        assert _listen_addresses(srv.proc.pid, srv.port) == {"127.0.0.1"}
        assert requests.get(srv.url + "/health", timeout=10).json()["auth"] is False


ENDPOINTS = [  # (method, path, body): every route the server has
    ("POST", "/upload", "rollout"),
    ("GET", "/get", None),
    ("GET", "/get?wait=0.1", None),
    ("GET", "/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/weights", None),
    ("GET", "/weights/version", None),
    ("PUT", "/weights?version=1", b"not safetensors"),
    ("GET", "/status", None),
    ("GET", "/", None),
    ("POST", "/heartbeat", b"{}"),
]


def test_token_required_everywhere_but_health(public_server):
    url = public_server.url
    assert _listen_addresses(public_server.proc.pid, public_server.port) == {"0.0.0.0"}
    h = requests.get(url + "/health", timeout=10)  # open: liveness probes carry no secret
    assert h.status_code == 200 and h.json()["auth"] is True
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                   {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Bearer {TOKEN[:-1]}"},
                   {"Authorization": "Bearer"}, {"Authorization": f"bearer{TOKEN}"}]
    for method, path, body in ENDPOINTS:
        data = encode_rollout(make_batch([3], [3])) if body == "rollout" else body
        for headers in bad_headers:
            r = requests.request(method, url + path, data=data, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert "token" in r.json()["error"] and r.headers.get("WWW-Authenticate") == "Bearer"
        r = requests.request(method, url + path, data=data, headers=AUTH, timeout=10)
        assert r.status_code != 401 and r.status_code < 500, (method, path, r.status_code, r.text)
    # the scheme is case-insensitive, the token is not
    assert requests.get(url + "/stats", headers={"Authorization": f"bearer {TOKEN}"}, timeout=10).ok
    assert requests.get(url + "/stats", headers={"Authorization": f"Bearer {TOKEN.upper()}"},
                        timeout=10).status_code == 401
    rejected = requests.get(url + "/stats", headers=AUTH, timeout=10).json()["uploads_rejected"]
    assert rejected.get("unauthorized", 0) >= len(ENDPOINTS) * len(bad_headers)


def test_token_compare_is_constant_time():
    """The check itself: hmac.compare_digest on the bearer value (no == on secrets)."""
    src = (REPO / "ref_server" / "auth.py").read_text()
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_authorized")
    calls = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert "hmac.compare_digest" in calls
    eq_on_token = [ast.unparse(c) for c in ast.walk(fn) if isinstance(c, ast.Compare) and "token" in ast.unparse(c)
                   and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in c.ops)]
    assert not eq_on_token, eq_on_token


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.invalid"])
def test_public_bind_without_token_refuses(host):
    r = subprocess.run([sys.executable, "-m", "ref_server", "--model", "tiny", "--host", host,
                        "--port", str(find_free_port())], cwd=REPO, env=subprocess_env(GRPO_REF_TOKEN=""),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refusing to bind" in r.stderr and "--insecure" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_public_bind_with_insecure_starts(tiny_model_dir):
    with start_ref_server(tiny_model_dir, "--host", "0.0.0.0", "--insecure",
                          env=subprocess_env(GRPO_REF_TOKEN="")) as srv:
        assert _listen_addresses(srv.proc.pid, srv.port) == {"0.0.0.0"}
        h = requests.get(srv.url + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["auth"] is False
        assert requests.get(srv.url + "/get", timeout=10).status_code == 204  # no token configured: open
        assert srv.stop() == 0


@pytest.mark.parametrize("method,target,limit_mb", [("POST", b"/upload", 1), ("PUT", b"/weights?version=5", 2)])
def test_body_limit_decided_from_the_header(public_server, method, target, limit_mb):
    """Content-Length over the limit, tiny body: 413 at once (no waiting for the body), connection closed,
    and the bytes after the header are never parsed as another request."""
    declared = (limit_mb << 20) + 1
    smuggled = b"GET /stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", public_server.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(method.encode() + b" " + target + b" HTTP/1.1\r\nHost: x\r\n" + b"Authorization: Bearer "
                  + TOKEN.encode() + b"\r\nContent-Length: " + str(declared).encode() + b"\r\n\r\n" + smuggled)
        data = _read_response(s, timeout=20)
        elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    assert b"exceed" in data and b'"error"' in data
    assert data.count(b"HTTP/1.1 ") == 1, data  # the 'body' was not served as a second request
    assert elapsed < 10, elapsed  # the server closed at once; it did not wait for ~MBs that never come
    print(f"413 for {method} {target.decode()} with Content-Length {declared} after {elapsed * 1000:.0f} ms")
    # and the server is fine afterwards
    assert requests.get(public_server.url + "/health", timeout=10).json()["status"] == "ok"


def test_body_limit_with_real_body(public_server):
    """A client that does send the oversized body still gets the JSON 413 (not a reset)."""
    r = requests.post(public_server.url + "/upload", data=b"\0" * ((1 << 20) + 10), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]
    b = make_batch([4], [4], seed=3)
    r = requests.post(public_server.url + "/upload", data=encode_rollout(b), headers=AUTH, timeout=30)
    assert r.status_code == 202
    while requests.get(public_server.url + "/get?wait=2", headers=AUTH, timeout=30).status_code == 200:
        pass  # drain what this module queued: the server then stops without a drain wait


# ---------------------------------------------------------------------------------------
UNPICKLERS = {  # module -> functions that deserialise arbitrary objects
    "pickle": {"load", "loads", "Unpickler"}, "cPickle": {"load", "loads", "Unpickler"},
    "_pickle": {"load", "loads", "Unpickler"}, "dill": {"load", "loads"}, "cloudpickle": {"load", "loads"},
    "marshal": {"load", "loads"}, "shelve": {"open"}, "joblib": {"load"}, "torch": {"load"},
    "numpy": {"load"}, "np": {"load"},
}


def _product_sources() -> list:
    skip = {".venv", "tests", "bench", ".git", "build", "runs"}
    return sorted(p for p in REPO.rglob("*.py") if not (set(p.relative_to(REPO).parts) & skip))


def test_no_unpickling_in_non_test_code():
    files = _product_sources()
    assert any(p.parts[-2:] == ("ref_server", "app.py") for p in files)
    hits = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> module, from imports
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if node.module.split(".")[0] in UNPICKLERS and a.name in UNPICKLERS[node.module.split(".")[0]]:
                        hits.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value,
                                                                                                ast.Name):
                mod = aliases.get(node.func.value.id, node.func.value.id).split(".")[0]
                if node.func.attr in UNPICKLERS.get(mod, ()):
                    if mod in ("numpy", "np") and not any(k.arg == "allow_pickle" for k in node.keywords):
                        continue  # np.load refuses pickles by default
                    hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not hits, "deserialisation of arbitrary objects in product code:\n" + "\n".join(hits)


def test_no_pickle_module_in_non_test_code():
    """Nothing in product code even imports a pickling module: what crosses a process boundary is JSON, safetensors
    or our own framing (TRL's `environments` copies too: trainer/rewards/env_state.py), so a pickled wire form
    cannot come back unnoticed."""
    hits = []
    for path in _product_sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            hits += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in UNPICKLERS
                     and n.split(".")[0] not in ("torch", "numpy")]
    assert not hits, "pickling modules imported in product code:\n" + "\n".join(hits)


def test_bench_torch_load_is_weights_only():
    """bench/wire.py measures simple_GRPO's torch.save framing (tests/simple_grpo_framing.py) as a baseline:
    its torch.load calls must stay weights_only=True (tensors only, no code), on bytes it made itself."""
    for path in [*sorted((REPO / "bench").glob("*.py")), REPO / "tests" / "simple_grpo_framing.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.load", "pickle.load", "pickle.loads"):
                assert ast.unparse(node.func) == "torch.load", f"{path.name}:{node.lineno}"
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("weights_only") == "True", f"{path.name}:{node.lineno}: {ast.unparse(node)}"


def test_pickled_tensor_is_refused_by_the_decoder():
    """The wire decoder is safetensors-only: a torch.save blob is a ProtocolError, never loaded."""
    import io

    from common.wire.protocol import ProtocolError, decode_rollout, decode_scored

    buf = io.BytesIO()
    torch.save({"input_ids": torch.ones(1, 3, dtype=torch.long)}, buf)
    for decode in (decode_rollout, decode_scored):
        with pytest.raises(ProtocolError):
            decode(buf.getvalue())
