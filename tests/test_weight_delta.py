"""Delta weight sync (issue 25): bit-exact over a sequence of versions through the real ref server, full copies
for workers that missed a version or start late, and deltas that are truncated, corrupt or do not fit never
applied (the server keeps its copy, a worker refetches the full weights and says so)."""
from __future__ import annotations

import logging
import time

import pytest
import requests
import torch
from conftest import start_ref_server

from common.modeling import load_model
from common.weights import delta as weight_delta
from common.weights.apply import HeldWeights
from common.weights.blob import ParametersBody, blob_metadata, tensors_from_blob, verify_blob
from common.weights.delta import DeltaEncoder, DeltaError, as_bits, checksum_of
from common.weights.sync import WeightSync
from common.wire.client import RefClient, RefServerError


@pytest.fixture(autouse=True)
def every_encoding(monkeypatch):
    """train_step changes 1 to 100 % of each tensor so that every encoding is used: a delta that size would go
    in full (DELTA_MAX_SHARE); here it goes as a delta whatever its size (tests/test_delta_encoding.py:
    test_large_change_goes_in_full)."""
    monkeypatch.setattr(weight_delta, "DELTA_MAX_SHARE", 1.0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with start_ref_server(tiny_model_dir) as srv:
        yield srv


def train_step(model, seed: int, lr: float = 3e-3) -> None:
    """A few elements of each tensor move by about one bf16 step, one tensor moves entirely, and odd values
    (NaN, -0.0) appear: every encoding (positions, bitmask, whole tensor) gets used."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.view(-1)
            if i == 0:
                flat.add_(lr)  # whole tensor
                continue
            k = max(1, flat.numel() // (100 if i % 2 else 8))  # 1 % (positions) or 12 % (bitmask)
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] += flat[idx].abs().clamp_min(1e-3) * 0.02
        flat = next(iter(model.parameters())).view(-1)
        flat[seed % flat.numel()] = float("nan")
        flat[(seed + 1) % flat.numel()] = -0.0


def bf16_bits(model) -> dict[str, torch.Tensor]:
    return {n: as_bits(p.detach().to(torch.bfloat16)).clone() for n, p in model.named_parameters()}


def held_bits(model) -> dict[str, torch.Tensor]:
    return {n: as_bits(p.detach()).clone() for n, p in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_n_deltas_rebuild_the_nth_full_publish_bit_exact(server, tiny_model_dir):
    trainer = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    worker = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    pub = WeightSync(client=RefClient(server.url), delta=True)
    sub = WeightSync(client=RefClient(server.url), delta=True)
    full_size = None
    for version in range(1, 6):
        if version > 1:
            train_step(trainer, version)
        _, nbytes = pub.publish(trainer, version, dtype=torch.bfloat16)
        assert pub.last_kind == ("full" if version == 1 else "delta")
        full_size = full_size or nbytes
        assert version == 1 or nbytes < full_size / 2
        assert sub.follow(worker) == version
        assert sub.last_kind == ("full" if version == 1 else "delta")
        assert same(held_bits(worker), bf16_bits(trainer))  # bit-identical to the trainer's publish
    _, nbytes = pub.publish(trainer, 6, dtype=torch.bfloat16)  # nothing changed: an empty delta
    assert pub.last_kind == "delta" and nbytes < 1000
    assert sub.follow(worker) == 6 and sub.last_kind == "delta" and same(held_bits(worker), bf16_bits(trainer))
    # the server's full copy (what a late worker gets) is the last full publish, CRC included
    blob = requests.get(server.url + "/weights").content
    expected = b"".join(ParametersBody(trainer, torch.bfloat16))
    assert blob == expected
    assert verify_blob(bytearray(blob))["__metadata__"]["xxh3"] == sub.held.crc == pub.encoder.crc
    info = RefClient(server.url).weights_info()
    assert info["served_delta_bytes"] > 0 and info["served_full_bytes"] >= full_size
    assert info["delta_check"] in ("ok", "pending")  # the server's own CRC check of its rebuilt copy


def test_behind_or_late_workers_get_the_full_copy(server, tiny_model_dir):
    trainer = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    current = WeightSync(client=RefClient(server.url), delta=True)
    behind = WeightSync(client=RefClient(server.url), delta=True)
    w1 = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    w2 = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    pub = WeightSync(client=RefClient(server.url), delta=True)
    base = RefClient(server.url).weights_version() or 0  # versions only move forward on the shared server
    for i in range(1, 4):
        train_step(trainer, 10 + i)
        pub.publish(trainer, base + i, dtype=torch.bfloat16)
        assert current.follow(w1) == base + i
        if i == 1:
            assert behind.follow(w2) == base + 1
    assert current.last_kind == "delta"
    assert behind.follow(w2) == base + 3 and behind.last_kind == "full"  # two behind: the full copy
    assert same(held_bits(w2), bf16_bits(trainer))
    late = WeightSync(client=RefClient(server.url), delta=True)
    w3 = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert late.follow(w3) == base + 3 and late.last_kind == "full"
    assert same(held_bits(w3), bf16_bits(trainer))
    off = WeightSync(client=RefClient(server.url), delta=False)  # --sync_delta false: full copies both ways
    train_step(trainer, 20)
    _, nbytes = off.publish(trainer, base + 4, dtype=torch.bfloat16)
    assert off.last_kind == "full" and nbytes == len(ParametersBody(trainer, torch.bfloat16))
    # the publisher that kept its copy now sends a delta from v(base+3), which the server no longer holds:
    train_step(trainer, 21)
    _, nbytes = pub.publish(trainer, base + 5, dtype=torch.bfloat16)
    assert pub.last_kind == "full"  # refused (409 'needs the full copy'), so published in full
    assert current.follow(w1) == base + 5 and same(held_bits(w1), bf16_bits(trainer))


def delta_blob(version: int, base_version: int, enc: DeltaEncoder, model) -> bytearray:
    tensors, meta = enc.delta(model.named_parameters())
    return bytearray(b"".join(ParametersBody(None, named=tensors, metadata={**meta,
                                                                           "base_version": str(base_version)})))


def test_truncated_or_corrupt_delta_is_never_applied(tiny_model_dir):
    trainer = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    with start_ref_server(tiny_model_dir) as srv:
        client = RefClient(srv.url)
        enc = DeltaEncoder(torch.bfloat16)
        client.publish_weights(ParametersBody(None, named=enc.snapshot(trainer.named_parameters()), crc=enc.crc), 1)
        before = requests.get(srv.url + "/weights").content
        train_step(trainer, 3)
        good = delta_blob(2, 1, enc, trainer)
        corrupt = bytearray(good)
        corrupt[-3] ^= 0x40
        for bad in (good[:-100], corrupt):
            with pytest.raises(RefServerError) as e:
                client.publish_weights(bytes(bad), 2)
            assert e.value.status == 400
            assert requests.get(srv.url + "/weights").content == before  # the copy held did not change
        other = DeltaEncoder(torch.bfloat16)
        other.snapshot(trainer.named_parameters())
        with pytest.raises(RefServerError) as e:  # a delta from a version the server does not hold
            client.publish_weights(bytes(delta_blob(3, 7, other, trainer)), 3)
        assert e.value.status == 409 and "needs the full copy" in e.value.message
        client.publish_weights(bytes(good), 2)
        assert requests.get(srv.url + "/weights/version").json()["version"] == 2


def test_delta_that_does_not_fit_changes_nothing():
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(100, generator=g).to(torch.bfloat16), "b": torch.randn(10, 40, generator=g).half()}
    enc = DeltaEncoder()
    blob = bytearray(b"".join(ParametersBody(None, named=enc.snapshot(w.items()), crc=enc.crc)))
    held = HeldWeights(tensors_from_blob(blob), 1, blob_metadata(blob)["xxh3"])
    snapshot = bytes(blob)
    w["a"][3] += 1
    w["b"][0, :] += 1
    tensors, meta = enc.delta(w.items())
    tensors, meta["base_version"] = dict(tensors), "1"
    assert sorted(tensors) == ["a:blk", "a:off", "a:val", "b:mask", "b:val"]
    bad_cases = [
        ({**tensors, "a:off": torch.tensor([100], dtype=torch.uint16)}, meta),  # position out of range
        ({**tensors, "a:blk": torch.tensor([2], dtype=torch.int32)}, meta),  # counts that do not add up
        ({**tensors, "b:val": tensors["b:val"][:-1]}, meta),  # fewer values than the bitmask selects
        ({**tensors, "c": torch.zeros(3)}, meta),  # a tensor the weights do not have
        ({**tensors, "a:val": tensors["a:val"].float()}, meta),  # wrong dtype
        (tensors, {**meta, "base_version": "0"}),  # another base
        (tensors, {**meta, "full_xxh3": "0" * 16}),  # rebuilds something else than the trainer's
    ]
    for i, (t, m) in enumerate(bad_cases):
        with pytest.raises(DeltaError):
            held.apply(dict(t), m, 2)
        if i < 6:  # refused before a byte changed
            assert bytes(blob) == snapshot
        else:
            blob[:] = snapshot  # the caller drops such a copy; restore it for the last check
    assert held.apply(dict(tensors), meta, 2) == ["a", "b"]
    assert held.crc == checksum_of(w.values()) and held.version == 2


def test_worker_whose_copy_went_bad_refetches_the_full_copy(tiny_model_dir, caplog):
    trainer = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    worker = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    with start_ref_server(tiny_model_dir) as srv:
        pub = WeightSync(client=RefClient(srv.url), delta=True)
        sub = WeightSync(client=RefClient(srv.url), delta=True)
        pub.publish(trainer, 1, dtype=torch.bfloat16)
        assert sub.follow(worker) == 1
        list(sub.held.tensors.values())[-1].add_(1)  # its copy no longer the trainer's v1 (the engine's is)
        train_step(trainer, 4)
        pub.publish(trainer, 2, dtype=torch.bfloat16)
        with caplog.at_level(logging.ERROR):
            assert sub.follow(worker) == 2
        assert "refetching the full copy" in caplog.text
        assert sub.last_kind == "full" and same(held_bits(worker), bf16_bits(trainer))


def wait_checked(store) -> str:
    for _ in range(200):
        if store.info()["delta_check"] != "pending":
            break
        time.sleep(0.05)
    return store.info()["delta_check"]


def test_server_copy_that_fails_its_crc_asks_for_the_full_copy():
    from ref_server.weights import StaleBase, WeightStore

    w = {"a": torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    enc = DeltaEncoder()
    store = WeightStore()
    store.publish(1, bytearray(b"".join(ParametersBody(None, named=enc.snapshot(w.items()), crc=enc.crc))))

    def delta(version: int, **meta) -> bytearray:
        w["a"][version] += 1
        tensors, m = enc.delta(w.items())
        return bytearray(b"".join(ParametersBody(None, named=tensors,
                                                 metadata={**m, "base_version": str(version - 1), **meta})))

    store.publish(2, delta(2))
    assert wait_checked(store) == "ok"
    store.publish(3, delta(3, full_xxh3="00000000deadbeef"))  # claims a CRC the rebuilt copy does not have
    assert wait_checked(store) == "failed"
    with pytest.raises(StaleBase, match="needs the full copy"):
        store.publish(4, delta(4))
    store.publish(4, bytearray(b"".join(ParametersBody(None, named=list(enc.last.items()), crc=enc.crc))))
    assert store.info()["delta_check"] is None and store.info()["version"] == 4


def test_server_answers_a_delta_before_rebuilding_and_full_fetches_wait_for_the_rebuild(monkeypatch):
    """The publish returns once the delta is checked; a worker one version behind gets the delta at once, a
    full fetch (and the next publish) waits until the copy rebuilt in the background is whole: what it gets
    passes its checksum and holds the new weights."""
    import threading

    import ref_server.weights as rw

    release, real = threading.Event(), rw.apply_plan
    monkeypatch.setattr(rw, "apply_plan", lambda base, steps: (release.wait(10), real(base, steps))[1])
    g = torch.Generator().manual_seed(2)
    w = {"a": torch.randn(70_000, generator=g).bfloat16(), "b": torch.randn(33, generator=g).bfloat16()}
    enc, store = DeltaEncoder(), rw.WeightStore()
    store.publish(1, bytearray(b"".join(ParametersBody(None, named=enc.snapshot(w.items()), crc=enc.crc))))
    w["a"][::97] += 1
    tensors, meta = enc.delta(w.items())
    store.publish(2, bytearray(b"".join(ParametersBody(None, named=tensors, metadata={**meta, "base_version": "1"}))))
    assert store.info()["version"] == 2 and store.info()["delta_check"] == "pending"  # answered, not rebuilt
    version, reader, kind = store.open_latest(since=1)
    assert (version, kind) == (2, "delta")
    reader.close()
    got: dict = {}
    fetch = threading.Thread(target=lambda: got.update(full=store.open_latest()))
    fetch.start()
    fetch.join(0.5)
    assert fetch.is_alive(), "a full fetch did not wait for the rebuild"
    release.set()
    fetch.join(10)
    version, reader, kind = got["full"]
    blob = bytearray(reader.read())
    reader.close()
    assert (version, kind) == (2, "full")
    rebuilt = tensors_from_blob(blob)  # its checksum: the trainer's full_xxh3
    assert blob_metadata(blob)["xxh3"] == meta["full_xxh3"] == enc.crc
    assert same({n: as_bits(t) for n, t in rebuilt.items()}, {n: as_bits(t) for n, t in w.items()})
    assert wait_checked(store) == "ok"
