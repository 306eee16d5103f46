"""How a rank waits for its own uploads (trainer/batches.py BatchSource).

Ranks share the server's output queue: a batch one rank uploaded is often taken by another. A rank whose
uploads are gone must not wait for them, only one whose uploads the server still holds (real ref server
over HTTP); uploads that died with a server are counted as lost and generated anew."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import start_ref_server
from test_ref_server import VOCAB, make_batch

from common.config import GRPOConfig
from common.settings.knobs import load_config
from common.wire.client import RefClient
from common.wire.protocol import ScoredBatch
from trainer.rollout import RolloutStats


class RecordingClient(RefClient):
    """The real client, noting each /get long-poll's timeout."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.waits: list[float] = []

    def get(self, timeout: float = 0.0):
        self.waits.append(timeout)
        return super().get(timeout)


@pytest.fixture
def own_uploads(monkeypatch):
    """generate_batches replaced by two fixed rollouts per call (the model is not what is tested here)."""
    import trainer.batches as tb

    made: list = []

    def fake_generate(*a, **k):
        bs = [make_batch([3], [3], seed=len(made) + i, producer_id="trainer-rank0") for i in range(2)]
        made.extend(bs)
        return bs, RolloutStats()

    monkeypatch.setattr(tb, "generate_batches", fake_generate)
    return made


class Sampler:
    def next_batch(self, n):
        return []

    def progress(self) -> float:  # PromptSampler's passes over the data (TRL's trainer_state.epoch)
        return 0.0


def test_uploads_taken_by_another_rank_cost_no_wait(tiny_model_dir, own_uploads):
    from trainer.batches import BatchSource

    cfg = load_config(GRPOConfig, ["--num_gen_workers", "0", "--max_new_tokens", "8", "--train_batch_groups", "1",
                                   "--temperature", "1.0"])  # make_batch sends no logp_temperature: T 1
    with start_ref_server(tiny_model_dir) as srv:
        client = RecordingClient(srv.url)
        src = BatchSource(cfg, client, None, None, Sampler(), [], [], VOCAB, producer_id="trainer-rank0")
        # step 1: nothing on the server, so generate and upload 2; wait for one while the server holds them
        batch, _ = src.next(policy_version=0)
        assert batch.batch_id == own_uploads[0].batch_id and src.in_flight == 1
        assert client.waits[0] == 0.0 and client.waits[1:] and set(client.waits[1:]) == {1.0}, client.waits
        # another rank takes our second upload
        other = RefClient(srv.url).get(timeout=30)
        assert other is not None and other.batch_id == own_uploads[1].batch_id
        # step 2: our upload is gone from the server: generate anew at once, no long-poll for it
        client.waits.clear()
        batch, info = src.next(policy_version=0)
        assert client.waits[0] == 0.0, client.waits
        assert len(own_uploads) == 4 and batch.batch_id == own_uploads[2].batch_id
        assert info["lost_batches"] == 0


def test_uploads_lost_with_the_server_are_counted_and_made_anew(own_uploads):
    """Unit level: uploads in flight when the server went away are counted as lost and generated anew."""
    from trainer.batches import BatchSource

    cfg = load_config(GRPOConfig, ["--num_gen_workers", "0", "--max_new_tokens", "8", "--temperature", "1.0"])

    class FlakyClient:
        urls = ["http://127.0.0.1:1"]

        def __init__(self):
            self.outages, self.uploaded, self.calls = 0, [], 0

        def get(self, timeout=0.0):
            self.calls += 1
            if self.calls == 2:  # the server died with our 2 uploads, and came back empty
                self.outages += 1
                return None
            if self.calls >= 3 and len(self.uploaded) >= 4:
                return ScoredBatch.from_rollout(self.uploaded[2], -torch.rand(1, 3))
            return None

        def upload(self, b):
            self.uploaded.append(b)

        def health(self, *a, **k):
            return {"queues": {"input": 0, "output": 0, "scoring": False}}

    client = FlakyClient()
    src = BatchSource(cfg, client, None, None, Sampler(), [], [], VOCAB, producer_id="trainer-rank0")
    batch, info = src.next(policy_version=0)
    assert info["lost_batches"] == 2 and len(client.uploaded) == 4 and batch.batch_id == own_uploads[2].batch_id
    assert src.in_flight == 1


def test_batches_it_can_never_use_end_the_rank_with_the_reason(tiny_model_dir):
    """A producer at another temperature (its batches carry no logp_temperature: T 1) against a trainer at T 0.9:
    every batch is refused. A usable one in between resets the count; max_rejected_batches in a row raise
    UnusableBatches naming the reason (trainer/loop.py turns it into exit 5 and the diagnosis line)."""
    from trainer.batches import BatchSource, UnusableBatches

    cfg = load_config(GRPOConfig, ["--num_gen_workers", "1", "--get_wait", "0", "--max_new_tokens", "8",
                                   "--train_batch_groups", "1", "--temperature", "0.9",
                                   "--max_rejected_batches", "3"])
    with start_ref_server(tiny_model_dir) as srv:
        client = RefClient(srv.url)
        src = BatchSource(cfg, client, None, None, Sampler(), [], [], VOCAB, producer_id="trainer-rank0")
        client.upload(make_batch([3], [3], seed=1, producer_id="byo"))  # T 1: refused
        client.upload(make_batch([3], [3], seed=2, producer_id="byo", extra={"logp_temperature": 0.9}))
        batch, info = src.next(policy_version=0)
        assert info["rejected_batches"] == 1 and batch.num_rows == 1 and src.rejected_in_a_row == 0
        for seed in (3, 4, 5):
            client.upload(make_batch([3], [3], seed=seed, producer_id="byo"))
        with pytest.raises(UnusableBatches, match=r"3 scored batches in a row rejected.*temperature 1\.0.*0\.9"):
            src.next(policy_version=0)


def test_max_rejected_batches_is_checked():
    with pytest.raises(ValueError, match="max_rejected_batches"):
        load_config(GRPOConfig, ["--max_rejected_batches", "-1"])


class NoWorkerClient:
    """A server that no worker feeds: /get long-polls run to their end empty; the rank's own uploads come back."""
    urls = ["http://127.0.0.1:1"]
    outages = 0

    def __init__(self):
        self.waits: list[float] = []
        self.uploaded: list = []

    def get(self, timeout=0.0):
        self.waits.append(timeout)
        if self.uploaded:
            return ScoredBatch.from_rollout(self.uploaded.pop(0), -torch.rand(1, 3))
        time.sleep(timeout)
        return None

    def upload(self, b):
        self.uploaded.append(b)

    def health(self, *a, **k):
        return {"queues": {"input": 0, "output": 0, "scoring": False}}


@pytest.mark.parametrize("get_wait, waits", [(0.5, [0.5]), (3.0, [2.0, 1.0])])
def test_a_rank_whose_workers_are_gone_generates_when_get_wait_ends(own_uploads, get_wait, waits):
    """The long-poll for a worker's batch goes in slices of at most 2 s, the last ending with get_wait: a whole
    2 s slice past it made such a rank wait get_wait 0.5 -> 2 s and 3 -> 4 s every step (what it does once its
    worker died: tests/test_faults.py)."""
    from trainer.batches import BatchSource

    cfg = load_config(GRPOConfig, ["--num_gen_workers", "1", "--get_wait", str(get_wait), "--max_new_tokens", "8",
                                   "--temperature", "1.0"])
    client = NoWorkerClient()
    src = BatchSource(cfg, client, None, None, Sampler(), [], [], VOCAB, producer_id="trainer-rank0")
    t0 = time.monotonic()
    batch, info = src.next(policy_version=0)
    took = time.monotonic() - t0
    assert batch.batch_id == own_uploads[0].batch_id
    assert client.waits[:len(waits)] == pytest.approx(waits, abs=0.05) and client.waits[len(waits)] == 0.0, client.waits
    assert get_wait <= took < get_wait + 0.5, took


def test_waiting_for_workers_only_or_while_they_start_polls_in_whole_slices():
    from trainer.batches import BatchSource

    for get_wait in ("0", "0.5"):
        cfg = load_config(GRPOConfig, ["--num_gen_workers", "1", "--get_wait", get_wait, "--temperature", "1.0"])
        src = BatchSource(cfg, NoWorkerClient(), None, None, Sampler(), [], [], VOCAB, producer_id="trainer-rank0")
        src.idle_since -= 10  # past get_wait: a rank that may not generate yet (its workers still start)
        assert src._worker_slice() == 2.0
