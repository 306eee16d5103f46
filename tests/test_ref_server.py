"""The ref server as a real process on 127.0.0.1, talked to over HTTP (requests / RefClient). Bad inputs:
tests/test_ref_server_inputs.py; the Scorer in process: tests/test_scorer.py."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from conftest import REPO, subprocess_env

from common.modeling import load_model
from common.wire.client import RefClient
from common.wire.protocol import CONTENT_TYPE, RolloutBatch, decode_scored, encode_rollout
from ref_server.config import ServerConfig, check_bind, load_server_config
from ref_server.serve import stop_http

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VOCAB, MAX_SEQ = 774, 2048  # the tiny model's (asserted against /health below)


def make_batch(prompt_lens: list[int], completion_lens: list[int], L: int | None = None, seed: int = 0,
               **kw) -> RolloutBatch:
    """Random tokens, right-padded with 0 to L (default: the longest row)."""
    g = torch.Generator().manual_seed(seed)
    pl, cl = torch.tensor(prompt_lens), torch.tensor(completion_lens)
    L = L or int((pl + cl).max())
    ids = torch.zeros(len(pl), L, dtype=torch.long)
    for i, n in enumerate((pl + cl).tolist()):
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
    T = int(cl.max())
    gen = -torch.rand(len(pl), T, generator=g) * (torch.arange(T)[None, :] < cl[:, None])
    return RolloutBatch(input_ids=ids, prompt_lens=pl, completion_lens=cl, advantages=torch.randn(len(pl), generator=g),
                        gen_logps=gen, rewards=torch.rand(len(pl), generator=g), **kw)


# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text(TOKEN + "\n")
    # Score budget below the concurrency test's arrival rate would still merge; 1 MiB bodies keep 413 cheap.
    with start_server(tiny_model_dir, "--token-file", str(token_file), "--max-body-mb", "1",
                      "--dtype", "float32", "--device", "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with RefClient(server.url, token=TOKEN, timeout=30, max_retries=3, backoff=0.1) as c:
        yield c


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def direct_ref_logps(model, b: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """Independent reference: full-vocab log_softmax(logits / T) in float64 over a plain forward, gathered."""
    L = b.input_ids.shape[1]
    mask = (torch.arange(L)[None, :] < (b.prompt_lens + b.completion_lens)[:, None]).long()
    with torch.no_grad():
        logp = (model(input_ids=b.input_ids, attention_mask=mask).logits.double() / temperature).log_softmax(-1)
    out = torch.zeros(b.num_rows, b.max_completion_len, dtype=torch.float64)
    for i in range(b.num_rows):
        p, c = int(b.prompt_lens[i]), int(b.completion_lens[i])
        pos = torch.arange(p, p + c)
        out[i, :c] = logp[i, pos - 1, b.input_ids[i, pos]]
    return out


# ---------------------------------------------------------------------------------------
def test_health_and_metrics(server, client):
    h = client.wait_ready(timeout=10)[0]
    assert h["status"] == "ok" and h["vocab_size"] == VOCAB and h["max_seq_len"] == MAX_SEQ
    assert h["dtype"] == "float32" and h["device"] == "cpu" and h["auth"] is True
    assert {"input", "output"} <= set(h["queues"]) and h["uptime_s"] >= 0
    assert "grpo_ref_uploads_accepted_total" in requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert "batches_scored" in client.stats()


def test_ref_logprobs_at_the_batch_temperature_and_skipped_when_not_needed(server, client, ref_model):
    """extra logp_temperature: ref logprobs of logits / T; needs_ref false (beta = 0): no forward, counted."""
    hot = make_batch([4, 6], [5, 3], seed=11, producer_id="t", extra={"logp_temperature": 0.7})
    skip = make_batch([3], [4], seed=12, producer_id="t", extra={"needs_ref": False})
    before = requests.get(server.url + "/stats", headers=AUTH, timeout=10).json()
    for b in (hot, skip):
        assert client.upload(b) == b.batch_id
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        s = client.get(timeout=5)
        if s is not None:
            got[s.batch_id] = s
    diff = (got[hot.batch_id].ref_logps.double() - direct_ref_logps(ref_model, hot, 0.7)).abs().max().item()
    assert diff <= 1e-5, diff
    assert (got[hot.batch_id].ref_logps.double() - direct_ref_logps(ref_model, hot)).abs().max().item() > 1e-3
    assert got[skip.batch_id].ref_logps is None
    after = requests.get(server.url + "/stats", headers=AUTH, timeout=10).json()
    assert after["batches_ref_skipped"] == before["batches_ref_skipped"] + 1
    assert after["forwards"] == before["forwards"] + 1  # only the batch that needs ref logprobs was forwarded
    st = requests.get(server.url + "/status", headers=AUTH, timeout=10).json()
    assert st["ref_forward"]["batches_ref_skipped"] == after["batches_ref_skipped"]
    # padding_free auto: chosen per scoring call from the work both ways (common/pack_choice.py, issue 45); both
    # rows are 9 tokens, so nothing to save by packing: padded, and no padded token computed either way
    assert st["ref_forward"]["padding_free"] is False and st["ref_forward"]["padding_share"] == 0.0
    assert after["padding_free"] is False and after["computed_tokens"] == after["forward_tokens"] > 0


def test_ref_logprobs_match_direct_forward(client, ref_model):
    batches = [
        make_batch([6, 6, 6, 6], [1, 9, 4, 12], seed=1, producer_id="exact"),                # ragged completions
        make_batch([2, 11, 5], [7, 3, 10], L=40, seed=2, producer_id="exact", extra={"k": [1, 2, 3]}),  # + padding
        make_batch([17], [5], seed=3, producer_id="exact", policy_version=7),
        make_batch([1, 30], [30, 1], L=64, seed=4, producer_id="exact"),
    ]
    for b in batches:  # uploaded back to back, so the server may merge them into one forward
        assert client.upload(b) == b.batch_id
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < len(batches) and time.monotonic() < deadline:
        s = client.get(timeout=5)
        if s is not None:
            got[s.batch_id] = s
    assert set(got) == {b.batch_id for b in batches}
    for b in batches:
        s = got[b.batch_id]
        assert torch.equal(s.input_ids, b.input_ids) and torch.equal(s.completion_lens, b.completion_lens)
        assert torch.equal(s.advantages, b.advantages) and torch.equal(s.gen_logps, b.gen_logps)
        assert s.policy_version == b.policy_version and s.extra == b.extra and s.producer_id == "exact"
        assert s.ref_logps.shape == (b.num_rows, b.max_completion_len) and s.ref_logps.dtype == torch.float32
        want = direct_ref_logps(ref_model, b)
        diff = (s.ref_logps.double() - want).abs().max().item()
        assert diff <= 1e-5, f"batch {b.batch_id}: max abs diff {diff}"
        assert (s.ref_logps[~b.completion_mask()] == 0).all()


# ---------------------------------------------------------------------------------------
def test_concurrent_uploads_each_batch_once_fifo(client):
    producers, per, getters = 8, 50, 2
    total = producers * per
    received: list[list[tuple[str, int]]] = [[] for _ in range(getters)]
    errors: list[BaseException] = []
    done = threading.Event()

    def produce(p: int) -> None:
        try:
            for i in range(per):  # 2 rows x 16 tokens: cheap to score, so this is all protocol and locking
                client.upload(make_batch([8, 6], [8, 10], L=16, seed=p * 1000 + i, producer_id=f"conc{p}",
                                         extra={"seq": i}))
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    def consume(g: int) -> None:
        try:
            deadline = time.monotonic() + 60
            while not done.is_set() and time.monotonic() < deadline:
                s = client.get(timeout=1.0)
                if s is None or not s.producer_id.startswith("conc"):
                    continue
                assert s.ref_logps.shape == (2, 10) and (s.ref_logps[0, 8:] == 0).all()
                received[g].append((s.producer_id, s.extra["seq"]))
                if sum(len(r) for r in received) >= total:
                    done.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume, args=(g,)) for g in range(getters)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    everything = [x for r in received for x in r]
    assert len(everything) == total and set(everything) == {(f"conc{p}", i) for p in range(producers)
                                                              for i in range(per)}
    for r in received:  # each getter sees a subsequence of the server's FIFO: per producer, increasing
        for p in range(producers):
            seqs = [i for pid, i in r if pid == f"conc{p}"]
            assert seqs == sorted(seqs)
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------------------
def test_full_queue_503_then_recovers_and_sigterm_exits_0(start_server, tiny_model_dir, caplog):
    # A small scored queue: once it is full the scorer waits, the input queue fills, uploads get 503.
    with start_server(tiny_model_dir, "--max-queue", "2", "--max-output-queue", "2", "--retry-after", "1") as srv:
        accepted, r = [], None
        for i in range(20):
            b = make_batch([5], [5], seed=i)
            r = requests.post(srv.url + "/upload", data=encode_rollout(b), timeout=10)
            if r.status_code != 202:
                break
            accepted.append(b.batch_id)
            time.sleep(0.05)  # let the scorer move batches along, so both queues fill
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and "queue" in r.json()["error"]
        assert 2 <= len(accepted) <= 5  # bounded: input cap + output cap (+ one in the scorer's hands)
        assert requests.get(srv.url + "/health", timeout=10).json()["queues"]["input"] == 2
        assert requests.get(srv.url + "/stats", timeout=10).json()["uploads_rejected"]["queue_full"] >= 1

        # A client upload now waits (503 + Retry-After) instead of failing, until someone drains.
        c = RefClient(srv.url, timeout=10, max_retries=2)
        late = make_batch([5], [5], seed=99)
        drained: list[str] = []

        def drain_later() -> None:
            time.sleep(1.5)
            while len(drained) < len(accepted) + 1:
                s = c.get(timeout=5)
                if s is None:
                    break
                drained.append(s.batch_id)

        t = threading.Thread(target=drain_later)
        t.start()
        with caplog.at_level(logging.INFO, logger="ref_client"):
            assert c.upload(late) == late.batch_id
        t.join(30)
        assert drained == accepted + [late.batch_id]  # FIFO, each exactly once
        assert sum("busy" in r.getMessage() for r in caplog.records) == 1
        assert any("is back" in r.getMessage() for r in caplog.records)
        assert requests.get(srv.url + "/get", timeout=10).status_code == 204

        last = make_batch([5], [5], seed=100)
        r = requests.post(srv.url + "/upload", data=encode_rollout(last), timeout=10)
        assert r.status_code == 202 and r.json()["queued"] >= 0

        # Graceful stop: uploads refused at once, scored work still handed out, then exit code 0.
        deadline = time.monotonic() + 10
        while requests.get(srv.url + "/health", timeout=10).json()["queues"]["output"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        while requests.get(srv.url + "/health", timeout=10).json()["status"] != "stopping":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = requests.post(srv.url + "/upload", data=encode_rollout(make_batch([5], [5], seed=101)), timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]
        r = requests.get(srv.url + "/get", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"] == CONTENT_TYPE
        assert decode_scored(r.content).batch_id == last.batch_id
        assert srv.proc.wait(30) == 0
        assert "ref server stopped" in srv.log() and "not fetched" not in srv.log()


# ---------------------------------------------------------------------------------------
def test_config_flags_and_bind_safety(tmp_path):
    a = load_server_config(["--model", "m", "--max-queue", "3", "--token-file=/x", "--max_output_queue", "5"])
    assert (a.max_queue, a.token_file, a.max_output_queue) == (3, "/x", 5)
    cfg_file = tmp_path / "server.json"
    cfg_file.write_text('{"model": "m", "port": 6000, "threads": 4}')
    b = load_server_config(["--config", str(cfg_file), "--port", "6001", "--insecure"])
    assert (b.model, b.port, b.threads, b.insecure) == ("m", 6001, 4, True)
    with pytest.raises(ValueError, match="model"):
        load_server_config([])
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "m", "nope": 1}')
    with pytest.raises(ValueError, match="unknown field"):
        load_server_config(["--config", str(bad)])
    with pytest.raises(ValueError, match="refusing to bind"):
        check_bind(ServerConfig(model="m", host="0.0.0.0"), token=None)
    check_bind(ServerConfig(model="m", host="0.0.0.0"), token="t")
    check_bind(ServerConfig(model="m", host="0.0.0.0", insecure=True), token=None)
    check_bind(ServerConfig(model="m", host="::1"), token=None)


def test_cli_help_and_refusals():
    r = subprocess.run([sys.executable, "-m", "ref_server", "--help"], cwd=REPO, env=subprocess_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--max_queue" in r.stdout and "Retry-After" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ref_server", "--model", "tiny", "--host", "0.0.0.0"], cwd=REPO,
                       env=subprocess_env(GRPO_REF_TOKEN=""), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to bind" in r.stderr


def test_stopping_waitress_with_a_request_in_flight_logs_no_traceback(caplog):
    """ref_server/serve.py's stop_http on a real waitress server while a request is being served: the request
    finishes and nothing is logged with a traceback. Closing the server first made the finishing request pull
    waitress's trigger on the closed pipe (EBADF, "Exception when servicing" with its traceback)."""
    import bottle
    from waitress import create_server

    app, started = bottle.Bottle(), threading.Event()

    @app.route("/slow")
    def slow():
        started.set()
        time.sleep(0.5)
        return "done"

    server = create_server(app, host="127.0.0.1", port=0, threads=2)
    threading.Thread(target=server.run, daemon=True).start()
    answers: list = []

    def ask() -> None:
        try:
            answers.append(requests.get(f"http://127.0.0.1:{server.effective_port}/slow", timeout=10).text)
        except requests.RequestException as e:
            answers.append(e)

    client = threading.Thread(target=ask)
    client.start()
    assert started.wait(10)
    with caplog.at_level(logging.WARNING, logger="waitress"):
        stop_http(server)
        client.join(10)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert answers == ["done"], answers
    assert not server.task_dispatcher.threads
