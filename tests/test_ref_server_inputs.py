"""The ref server as a real process, fed what a careless or hostile client sends: every bad upload is a clear 4xx
(never a 5xx, never unpickled), HTTP-level errors are JSON, and the server stays healthy afterwards."""
from __future__ import annotations

import logging
import os
import pickle
import socket

import pytest
import requests
import torch
from conftest import find_free_port
from safetensors.torch import save as st_save
from test_ref_server import AUTH, MAX_SEQ, TOKEN, VOCAB, make_batch

from common.wire.client import RefClient, RefServerError
from common.wire.protocol import encode_rollout


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text(TOKEN + "\n")
    # 1 MiB bodies keep 413 cheap.
    with start_server(tiny_model_dir, "--token-file", str(token_file), "--max-body-mb", "1",
                      "--dtype", "float32", "--device", "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with RefClient(server.url, token=TOKEN, timeout=30, max_retries=3, backoff=0.1) as c:
        yield c


def raw_message(tensors: dict, **meta: str) -> bytes:
    """A safetensors message with arbitrary (possibly invalid) content, bypassing encode-side checks."""
    header = {"kind": "rollout", "protocol_version": "1", "policy_version": "0", "producer_id": "t",
              "batch_id": "raw", "extra": "{}", **meta}
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=header)


def good_tensors() -> dict:
    b = make_batch([3, 4], [5, 2], seed=1)
    return {"input_ids": b.input_ids, "prompt_lens": b.prompt_lens, "completion_lens": b.completion_lens,
            "advantages": b.advantages}


def post(url: str, body: bytes, headers: dict | None = None) -> requests.Response:
    return requests.post(url + "/upload", data=body, headers={**AUTH, **(headers or {})}, timeout=30)


def raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


# ---------------------------------------------------------------------------------------
class _Boom:
    """Unpickling this would create a directory: proof that the server never unpickles."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _bad(**changes) -> bytes:
    t = good_tensors()
    meta = {k: changes.pop(k) for k in list(changes) if isinstance(changes[k], str)}
    for k, v in changes.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    return raw_message(t, **meta)


BAD_UPLOADS = {
    "garbage": (b"definitely not safetensors", "header length"),
    "empty body": (b"", "too short"),
    "json": (b'{"input_ids": [[1, 2, 3]]}', "header"),
    "token id >= vocab": (_bad(input_ids=torch.full((2, 8), VOCAB, dtype=torch.long)), "vocab size"),
    "negative token id": (_bad(input_ids=torch.full((2, 8), -1, dtype=torch.long)), "negative"),
    "prompt >= max seq len": (raw_message({"input_ids": torch.ones(1, MAX_SEQ + 1, dtype=torch.long),
                                           "prompt_lens": torch.tensor([MAX_SEQ]), "completion_lens": torch.tensor([1]),
                                           "advantages": torch.zeros(1)}), "sequence length"),
    "nan advantages": (_bad(advantages=torch.tensor([0.5, float("nan")])), "advantages"),
    "inf advantages": (_bad(advantages=torch.tensor([float("inf"), 0.5])), "advantages"),
    "unknown protocol version": (_bad(protocol_version="99"), "protocol version"),
    "wrong kind": (_bad(kind="scored"), "rollout"),
    "rows disagree": (_bad(prompt_lens=torch.tensor([3, 4, 5])), "prompt_lens"),
    "lengths exceed row": (_bad(completion_lens=torch.tensor([5, 50])), "row length"),
    "missing tensor": (_bad(advantages=None), "missing"),
    "float token ids": (_bad(input_ids=torch.ones(2, 8)), "dtype"),
    "unknown tensor": (_bad(weights=torch.ones(3)), "unknown tensor"),
    "positive gen logps": (_bad(gen_logps=torch.ones(2, 5)), "positive"),
    "truncated list of the wrong length": (_bad(extra='{"truncated": [true]}'), "truncated"),
    "truncated not booleans": (_bad(extra='{"truncated": [1, 0]}'), "truncated"),
    "bad logp_temperature": (_bad(extra='{"logp_temperature": 0}'), "logp_temperature"),
    "pickled dict": (pickle.dumps({"input_ids": [[1, 2, 3]], "prompt_lens": [1]}), ""),
    "pickled tensor": (pickle.dumps(torch.ones(2, 3)), ""),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_upload_is_400(server, case):
    body, needle = BAD_UPLOADS[case]
    r = post(server.url, body)
    assert r.status_code == 400, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert needle.lower() in r.json()["error"].lower()


def test_pickle_payload_is_never_unpickled(server, tmp_path):
    marker = tmp_path / "unpickled"
    r = post(server.url, pickle.dumps({"x": _Boom(str(marker)), "t": torch.zeros(3)}))
    assert r.status_code == 400 and "error" in r.json()
    assert not marker.exists()


def test_http_level_errors(server):
    url = server.url
    big = b"\0" * ((1 << 20) + 1)  # one byte over --max-body-mb 1
    r = post(url, big)
    assert r.status_code == 413 and "limit" in r.json()["error"]
    # A huge declared length is refused from the header alone (the body is never sent).
    head = raw_http(server.port, b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n"
                                 b"Authorization: Bearer " + TOKEN.encode() + b"\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    head = raw_http(server.port, b"POST /upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                    + b"\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411") and b'"error"' in head
    body = encode_rollout(make_batch([3], [3]))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer \u00e9t\u00e9"}):
        r = requests.post(url + "/upload", data=body, headers=headers, timeout=10)
        assert r.status_code == 401 and "token" in r.json()["error"], headers
    assert requests.get(url + "/get", timeout=10).status_code == 401
    for method, path, status in [("GET", "/nope", 404), ("POST", "/", 405), ("POST", "/nope", 404),
                                 ("GET", "/upload", 405), ("POST", "/get", 405), ("DELETE", "/health", 405),
                                 ("PUT", "/upload", 405)]:
        r = requests.request(method, url + path, headers=AUTH, timeout=10)
        assert r.status_code == status and "error" in r.json(), (method, path)
        assert "Traceback" not in r.text and "<html" not in r.text.lower()
    for wait in ("abc", "-1", "nan", "inf", "\xe9\xff"):
        r = requests.get(url + "/get", params={"wait": wait}, headers=AUTH, timeout=10)
        assert r.status_code == 400 and "wait" in r.json()["error"], wait
    assert requests.get(url + "/get", headers=AUTH, timeout=10).status_code == 204
    # Raw bytes that are not UTF-8 in the path, query and headers: still JSON 4xx, never a 5xx.
    for target in (b"/get?wait=%E9%FF", b"/\xe9\xff", b"/get?wait=\xe9"):
        head = raw_http(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                        + TOKEN.encode() + b"\r\nX-Odd: \xe9\xff\r\nConnection: close\r\n\r\n")
        assert head[9:10] == b"4", head[:200]


def test_client_errors_are_clear(server, caplog):
    with RefClient(server.url, token="wrong", timeout=10) as c:
        with pytest.raises(RefServerError) as e:
            c.upload(make_batch([3], [3]))
    assert e.value.status == 401 and "token" in e.value.message
    dead = f"http://127.0.0.1:{find_free_port()}"
    with caplog.at_level(logging.INFO, logger="ref_client"), RefClient(dead, max_retries=3, backoff=0.01) as c:
        with pytest.raises(RefServerError) as e:
            c.upload(make_batch([3], [3]))
        with pytest.raises(TimeoutError):
            c.wait_ready(timeout=0.3, poll=0.1)
    assert e.value.status == 0 and "gave up after 3 retries" in str(e.value)
    assert sum("retrying with backoff" in r.getMessage() for r in caplog.records) == 1  # once per outage


def test_server_healthy_after_bad_inputs(server, client):
    # Runs after the error tests (file order): nothing they sent may have hurt the server.
    assert client.health()["status"] == "ok"
    st = client.stats()
    assert st["uploads_rejected"].get("bad_request", 0) >= len(BAD_UPLOADS)
    assert st["uploads_rejected"].get("unauthorized", 0) >= 4 and st["scoring_errors"] == 0
    b = make_batch([4], [4], seed=9, producer_id="after")
    client.upload(b)
    s = client.get(timeout=10)
    assert s is not None and s.batch_id == b.batch_id
