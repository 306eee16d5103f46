"""Weight sync integrity: a checksum in every blob, verified before loading; broken downloads retried.

A relay (a small HTTP server in front of the real ref server) breaks the first weight downloads:
it cuts the body, stalls mid-body, or flips a byte. The worker logs it, keeps its weights, retries,
and ends up with logprobs equal to the trainer's.
"""
from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch
from conftest import start_ref_server
from test_weight_sync import logps, perturbed

from common.modeling import load_model
from common.weights.blob import IntegrityError, parameters_blob, tensors_from_blob, verify_blob
from common.weights.sync import WeightSync
from common.wire.client import RefClient


class Relay:
    """Forwards every request to `upstream`; the first len(faults) GET /weights are broken as listed."""

    def __init__(self, upstream: str, faults: list[str]) -> None:
        self.upstream, self.faults, self.weight_gets = upstream, list(faults), 0
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                r = requests.get(relay.upstream + self.path, headers={k: v for k, v in self.headers.items()
                                                                      if k.lower() != "host"}, timeout=30)
                fault = None
                if self.path.split("?")[0] == "/weights" and r.status_code == 200:
                    relay.weight_gets += 1
                    fault = relay.faults.pop(0) if relay.faults else None
                body = bytearray(r.content)
                self.send_response(r.status_code)
                for k in ("Content-Type", "X-Policy-Version"):
                    if k in r.headers:
                        self.send_header(k, r.headers[k])
                self.send_header("Content-Length", str(len(body)))
                if fault in ("cut", "stall"):
                    self.send_header("Connection", "close")
                self.end_headers()
                if fault == "cut":  # half the body, then the connection closes
                    self.wfile.write(body[:len(body) // 2])
                    self.close_connection = True
                    return
                if fault == "stall":  # half the body, then silence longer than the client's read timeout
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    time.sleep(4.0)
                    self.close_connection = True
                    return
                if fault == "corrupt":  # the full length, one byte changed deep in the data
                    body[-1000] ^= 0xFF
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with start_ref_server(tiny_model_dir) as srv:
        yield srv


@pytest.mark.parametrize("faults", [["cut"], ["stall"], ["corrupt"], ["cut", "corrupt", "stall"]])
def test_broken_download_is_retried_and_never_loaded(server, tiny_model_dir, faults, caplog):
    version = {"cut": 101, "stall": 102, "corrupt": 103}[faults[0]] + 10 * (len(faults) - 1)
    trainer_model = perturbed(tiny_model_dir, version)
    WeightSync(client=RefClient(server.url)).publish(trainer_model, version=version)
    relay = Relay(server.url, faults)
    try:
        worker_model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
        before = logps(worker_model)
        # a follower that already holds v1 (the relay breaks the downloads; the server has the new version)
        sub = WeightSync(client=RefClient(relay.url, timeout=2.0))
        sub.version = 1
        with caplog.at_level(logging.WARNING):
            # retries=0: the first attempt fails, the model keeps its weights, follow() says None
            assert sub.follow(worker_model, retries=0) is None
        assert sub.version == 1 and torch.equal(logps(worker_model), before)
        assert "weights download failed" in caplog.text
        got = sub.follow(worker_model, retries=len(faults), backoff=0.05)
        assert got == version and sub.version == version
        assert relay.weight_gets == len(faults) + 1
        assert (logps(worker_model) - logps(trainer_model)).abs().max().item() <= 1e-5
    finally:
        relay.close()


def test_versions_only_move_forward(server, tiny_model_dir, caplog):
    model = perturbed(tiny_model_dir, 7)
    WeightSync(client=RefClient(server.url)).publish(model, version=500)
    sub = WeightSync(client=RefClient(server.url))
    sub.version = 499
    # the server says 500, but by the time we fetch a restarted server could hand out less: simulated here
    orig = sub.client.fetch_weights
    sub.client.fetch_weights = lambda since=None: (400, orig()[1])
    with caplog.at_level(logging.WARNING):
        assert sub.follow(model) is None
    assert sub.version == 499 and "not newer" in caplog.text


def test_every_blob_carries_a_checksum_that_is_checked(tiny_model_dir, tmp_path):
    model = perturbed(tiny_model_dir, 3)
    blob = bytearray(parameters_blob(model))
    header = verify_blob(blob)
    assert len(header["__metadata__"]["xxh3"]) == 16
    assert set(tensors_from_blob(blob)) == {n for n, _ in model.named_parameters()}
    for breaker, message in [(lambda b: b.__setitem__(len(b) - 5, b[-5] ^ 1), "xxh3"),
                             (lambda b: b.__delitem__(slice(len(b) - 100, None)), "data section"),
                             (lambda b: b.__delitem__(slice(20, None)), "truncated"),
                             (lambda b: b.__delitem__(slice(4, None)), "too short")]:
        bad = bytearray(blob)
        breaker(bad)
        with pytest.raises(IntegrityError, match=message):
            tensors_from_blob(bad)
    # a blob without a checksum (e.g. from an older trainer) is refused, not loaded unchecked
    from safetensors.torch import save
    plain = bytearray(save({"w": torch.ones(3)}))
    with pytest.raises(IntegrityError, match="no xxh3"):
        tensors_from_blob(plain)


def test_shared_dir_blob_is_verified(tiny_model_dir, tmp_path):
    model = perturbed(tiny_model_dir, 4)
    WeightSync(sync_dir=str(tmp_path)).publish(model, version=3)
    f = next(tmp_path.glob("policy-v3.safetensors"))
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(data)
    worker = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    before = logps(worker)
    assert WeightSync(sync_dir=str(tmp_path)).follow(worker, retries=1, backoff=0.01) is None
    assert torch.equal(logps(worker), before)
