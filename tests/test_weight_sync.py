"""Workers follow the policy: weights published by the trainer reach a worker over HTTP or a shared dir."""
from __future__ import annotations

import pytest
import requests
import torch
from conftest import start_ref_server

from common.logprobs import sequence_logprobs
from common.modeling import load_model
from common.weights.blob import parameters_blob
from common.weights.sync import WeightSync, load_parameters
from common.wire.client import RefClient, RefServerError
from common.wire.protocol import RolloutBatch, ScoredBatch


def fixed_sequence():
    g = torch.Generator().manual_seed(5)
    return torch.randint(5, 500, (3, 20), generator=g), torch.tensor([5, 6, 7]), torch.tensor([15, 10, 13])


def perturbed(model_dir, seed: int):
    """The 'trained' policy: the tiny model with every parameter moved."""
    model = load_model(str(model_dir), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def logps(model):
    ids, pl, cl = fixed_sequence()
    with torch.no_grad():
        return sequence_logprobs(model, ids, pl, cl)[0]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with start_ref_server(tiny_model_dir) as srv:
        yield srv


def test_worker_matches_trainer_after_http_sync(server, tiny_model_dir):
    trainer_model = perturbed(tiny_model_dir, 1)
    worker_model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    before = (logps(worker_model) - logps(trainer_model)).abs().max().item()
    assert before > 1e-3  # they differ before the sync

    client = RefClient(server.url)
    pub, sub = WeightSync(client=client), WeightSync(client=RefClient(server.url))
    seconds, nbytes = pub.publish(trainer_model, version=10)
    assert nbytes > 1_000_000 and seconds >= 0
    assert client.weights_version() == 10
    def announced() -> int | None:  # what a worker paused by worker_max_queued reads off /health to follow it
        return requests.get(server.url + "/health").json()["policy_version"]

    assert sub.is_newer(announced()) and not sub.is_newer(None)
    assert sub.follow(worker_model) == 10
    after = (logps(worker_model) - logps(trainer_model)).abs().max().item()
    assert after <= 1e-5
    assert sub.follow(worker_model) is None  # nothing newer: no fetch
    assert announced() == 10 and not sub.is_newer(announced()) and not sub.is_newer(9)


def test_successive_publishes_reuse_memory_and_deliver_each_version(server, tiny_model_dir):
    """The relay recycles a retired blob's memory for the next publish: every fetch must still be
    exactly the newest weights, also while an older GET is still streaming."""
    client = RefClient(server.url)
    pub, sub = WeightSync(client=client), WeightSync(client=RefClient(server.url))
    worker = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    slow = None
    for i, version in enumerate((11, 12, 13, 14)):  # between the neighbouring tests' versions
        model = perturbed(tiny_model_dir, 100 + version)
        pub.publish(model, version)
        if i == 1:  # a reader that holds v12 open across the next publishes
            slow = requests.get(server.url + "/weights", stream=True)
            assert slow.headers["X-Policy-Version"] == "12"
            head = slow.raw.read(1 << 16)
        assert sub.follow(worker) == version
        assert all(torch.equal(a, b) for a, b in zip(worker.parameters(), model.parameters())), version
    expected = parameters_blob(perturbed(tiny_model_dir, 112))
    rest = slow.raw.read()
    slow.close()
    assert head + rest == expected  # v12's memory was not recycled while it was being sent


def test_weight_store_spare_only_when_nobody_reads():
    from ref_server.weights import WeightStore

    def blob(fill: int, n: int = 64):
        import json
        h = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
        h += b" " * (-len(h) % 8)
        return bytearray(len(h).to_bytes(8, "little") + h + bytes([fill]) * n)

    store = WeightStore()
    b1 = blob(1)
    store.publish(1, b1)
    version, reader, _ = store.open_latest()
    assert version == 1 and bytes(reader.read()) == bytes(b1)
    store.publish(2, blob(2))
    assert store.buffer(len(b1)) is not b1  # v1 is still being read: never handed out for writing
    reader.close()
    reader.close()  # closing twice counts once
    assert store.buffer(len(b1)) is b1  # now it is recycled
    store.publish(3, blob(3, n=128))  # retires v2 as the spare
    assert len(store.buffer(10)) == 10  # a size that does not fit: fresh memory, the spare is let go


def test_versions_only_move_forward_and_blobs_are_checked(server, tiny_model_dir):
    client = RefClient(server.url)
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    client.publish_weights(parameters_blob(model), 20)
    with pytest.raises(RefServerError) as e:
        client.publish_weights(parameters_blob(model), 20)
    assert e.value.status == 409
    r = requests.put(server.url + "/weights", params={"version": "21"}, data=b"\x80\x03}q\x00.")  # a pickle
    assert r.status_code == 400 and "error" in r.json()
    r = requests.put(server.url + "/weights", params={"version": "x"}, data=b"12345678")
    assert r.status_code == 400
    assert client.weights_version() == 20


def test_weights_must_fit_the_model(tiny_model_dir):
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    from safetensors.torch import load
    tensors = load(parameters_blob(model))
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="missing"):
        load_parameters(model, {k: v for k, v in tensors.items() if k != name})
    bad = dict(tensors)
    bad[name] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        load_parameters(model, bad)


def test_shared_directory_transport(tmp_path, tiny_model_dir):
    trainer_model = perturbed(tiny_model_dir, 2)
    worker_model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    pub, sub = WeightSync(sync_dir=str(tmp_path)), WeightSync(sync_dir=str(tmp_path))
    assert sub.follow(worker_model) is None  # nothing published yet
    pub.publish(trainer_model, 1)
    pub.publish(trainer_model, 2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["policy-v2.safetensors"]
    assert sub.follow(worker_model) == 2
    assert (logps(worker_model) - logps(trainer_model)).abs().max().item() <= 1e-5


def test_worker_recovers_after_missed_sync_and_server_restart(tiny_model_dir, free_port):
    """Server dies (weights gone) and comes back: the worker keeps its weights and takes the next version."""
    worker_model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    v1, v2 = perturbed(tiny_model_dir, 3), perturbed(tiny_model_dir, 4)
    sub = WeightSync(client=RefClient(f"http://127.0.0.1:{free_port}", max_retries=2, backoff=0.1))
    with start_ref_server(tiny_model_dir, port=free_port) as srv:
        WeightSync(client=RefClient(srv.url)).publish(v1, 1)
        assert sub.follow(worker_model) == 1
        srv.stop()
    with pytest.raises(RefServerError):  # server down: the worker's round fails loudly, weights untouched
        sub.follow(worker_model)
    assert (logps(worker_model) - logps(v1)).abs().max().item() <= 1e-5
    with start_ref_server(tiny_model_dir, port=free_port) as srv:
        assert sub.follow(worker_model) is None  # the new server has no weights yet
        WeightSync(client=RefClient(srv.url)).publish(v2, 2)
        assert sub.follow(worker_model) == 2
    assert (logps(worker_model) - logps(v2)).abs().max().item() <= 1e-5


def test_stale_batches_are_dropped_and_counted(server, tiny_model_dir):
    """BatchSource drops scored batches older than max_staleness versions."""
    from common.config import GRPOConfig
    from common.modeling import load_tokenizer
    from trainer.batches import BatchSource

    client = RefClient(server.url)
    while client.get(timeout=0.0) is not None:  # start from an empty queue
        pass
    ids, pl, cl = fixed_sequence()

    def batch(version: int) -> RolloutBatch:
        return RolloutBatch(input_ids=ids, prompt_lens=pl, completion_lens=cl, advantages=torch.tensor([1., 0., -1.]),
                            policy_version=version, producer_id="test")

    for v in (1, 9, 10):  # trainer at version 10 with max_staleness 2: version 1 is stale
        client.upload(batch(v))
    cfg = GRPOConfig(num_gen_workers=1, get_wait=0.0, max_staleness=2, train_batch_groups=2, max_new_tokens=16,
                     temperature=1.0)  # the batches carry no logp_temperature: T = 1
    tok = load_tokenizer(str(tiny_model_dir))
    src = BatchSource(cfg, client, None, tok, None, [], [], len(tok), producer_id="rank0")
    got, info = src.next(policy_version=10)
    assert isinstance(got, ScoredBatch)
    assert info["dropped_stale"] == 1
    assert got.policy_version == 9 and got.num_rows == 6


def test_publish_from_ready_copies_in_full_and_as_delta(server, tiny_model_dir):
    """Under ZeRO-3 rank 0 publishes the CPU copies it gathered a group at a time (trainer/dist/gather.py), never
    the partitioned model: `weights` stands for model.named_parameters() in a full copy and in a delta alike."""
    from trainer.dist.gather import cpu_copies

    policy = perturbed(tiny_model_dir, 30)
    partitioned = load_model(str(tiny_model_dir), device="cpu", dtype="float32")  # not what is sent
    worker = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    pub = WeightSync(client=RefClient(server.url), delta=True)
    sub = WeightSync(client=RefClient(server.url), delta=True)
    for version, kind in ((30, "full"), (31, "delta")):
        if kind == "delta":
            with torch.no_grad():
                next(policy.parameters())[0, :5] += 1.0
        copies = cpu_copies(policy.named_parameters(), zero_stage=0, rank=0, dtype=torch.bfloat16)
        assert list(copies) == [n for n, _ in policy.named_parameters()]
        pub.publish(partitioned, version, dtype=torch.bfloat16, weights=copies)
        assert pub.last_kind == kind
        assert sub.follow(worker) == version and sub.last_kind == kind
        for (n, p), q in zip(worker.named_parameters(), policy.parameters()):
            assert torch.equal(p, q.to(torch.bfloat16).float()), (version, n)
