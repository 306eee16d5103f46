"""Bad input on the trainer side: what /get hands back is validated before training (decode_scored in
common/wire/protocol.py, check_scored in trainer/batches.py); a bad batch is counted and skipped. The server
side of bad input is tests/test_fuzz.py, whose message builders (tests/fuzz_messages.py) these tests reuse."""
from __future__ import annotations

import pytest
import torch
from fuzz_messages import meta, st_blob
from test_ref_server import VOCAB, make_batch

from common.config import GRPOConfig
from common.settings.knobs import load_config
from common.wire.protocol import ProtocolError, ScoredBatch, decode_scored, encode_rollout, encode_scored


def _cfg(**kw) -> GRPOConfig:
    args = []
    for k, v in {"max_new_tokens": 8, "beta": 0.04, "num_gen_workers": 1, "get_wait": 0, "temperature": 1.0,
                 **kw}.items():
        args += [f"--{k}", str(v)]
    return load_config(GRPOConfig, args)


def _scored(**over) -> ScoredBatch:
    b = make_batch([3, 4], [5, 2], seed=5, producer_id="other")
    ref = -torch.rand(2, 5) * b.completion_mask()
    s = ScoredBatch.from_rollout(b, ref)
    for k, v in over.items():
        setattr(s, k, v)
    return s


def _scored_blob(**changes) -> bytes:
    s = _scored()
    t = {k: getattr(s, k) for k in ("input_ids", "prompt_lens", "completion_lens", "advantages", "gen_logps",
                                     "rewards", "ref_logps")}
    t.update(changes)
    arr = {k: ({torch.int64: "I64", torch.float32: "F32"}[v.dtype], v.numpy()) for k, v in t.items() if v is not None}
    return st_blob(arr, meta("scored", batch_id="bad-scored"))


@pytest.mark.parametrize("changes,needle", [
    ({"ref_logps": -torch.ones(2, 6)}, "'ref_logps' has shape (2, 6), expected (2, 5)"),
    ({"ref_logps": -torch.ones(3, 5)}, "'ref_logps' has shape (3, 5)"),
    ({"ref_logps": torch.full((2, 5), float("nan"))}, "'ref_logps' contains NaN"),
    ({"ref_logps": torch.ones(2, 5)}, "'ref_logps' has positive log-probabilities"),
    ({"ref_logps": -torch.ones(2, 5, dtype=torch.int64)}, "'ref_logps' has dtype"),
    ({"input_ids": -torch.ones(2, 9, dtype=torch.int64)}, "negative token id"),
    ({"completion_lens": torch.tensor([5, 9])}, "row length"),
])
def test_decode_scored_rejects_bad_messages(changes, needle):
    with pytest.raises(ProtocolError) as e:
        decode_scored(_scored_blob(**changes))
    assert needle in str(e.value), str(e.value)


def test_decode_scored_rejects_a_rollout_message():
    with pytest.raises(ProtocolError, match="expected a 'scored' message"):
        decode_scored(encode_rollout(make_batch([3], [3])))


def test_check_scored_rejects_what_this_trainer_cannot_use():
    from trainer.batches import check_scored

    cfg = _cfg(temperature=1.0)
    ok = decode_scored(encode_scored(_scored()))
    check_scored(ok, cfg, VOCAB)
    beyond = _scored()
    beyond.input_ids = beyond.input_ids.clone()
    beyond.input_ids[1, 2] = VOCAB + 3  # the server's model has a bigger vocab than the policy: must not index
    beyond = decode_scored(encode_scored(beyond))
    with pytest.raises(ProtocolError, match=rf"token ids beyond the policy vocab \({VOCAB}\)"):
        check_scored(beyond, cfg, VOCAB)
    no_ref = decode_scored(encode_scored(_scored(ref_logps=None)))
    with pytest.raises(ProtocolError, match="has no ref_logps but beta=0.04"):
        check_scored(no_ref, cfg, VOCAB)
    check_scored(no_ref, _cfg(beta=0, temperature=1.0), VOCAB)  # beta 0 needs no reference
    with pytest.raises(ProtocolError, match="longer than max_new_tokens"):
        check_scored(ok, _cfg(max_new_tokens=4, temperature=1.0), VOCAB)
    # logprobs at another temperature than this trainer's (issue 24): no extra key = T 1 (raw distribution)
    with pytest.raises(ProtocolError, match="temperature 1.0, this trainer computes its own at 0.9"):
        check_scored(ok, _cfg(temperature=0.9), VOCAB)
    check_scored(ok, _cfg(temperature=0.9, logp_temperature=1.0), VOCAB)  # simple_GRPO's T = 1
    hot = decode_scored(encode_scored(_scored(extra={"logp_temperature": 0.9})))
    check_scored(hot, _cfg(temperature=0.9), VOCAB)
    # a truncated list that does not fit the batch: refused at decode, and by the trainer that reads it
    short = _scored(extra={"truncated": [True]})
    with pytest.raises(ProtocolError, match="truncated"):
        decode_scored(encode_scored(short))
    with pytest.raises(ProtocolError, match="truncated"):
        check_scored(short, _cfg(temperature=1.0, mask_truncated=True), VOCAB)


def test_batch_source_skips_a_bad_scored_batch_and_counts_it():
    """A bad batch from /get is logged, counted in rejected_batches and skipped; training goes on."""
    from trainer.batches import BatchSource

    bad = _scored()
    bad.input_ids = bad.input_ids.clone()
    bad.input_ids[0, 0] = VOCAB
    good = _scored(batch_id="good")

    class FakeClient:
        outages = 0

        def __init__(self):
            self.queue = [bad, good]

        def get(self, timeout=0.0):
            return self.queue.pop(0) if self.queue else None

        def health(self, *a, **k):
            return {"queues": {}}

    src = BatchSource(_cfg(), FakeClient(), None, None, None, [], [], VOCAB, producer_id="trainer-rank0")
    batch, info = src.next(policy_version=0)
    assert batch.batch_id == "good" and info["rejected_batches"] == 1 and info["lost_batches"] == 0
