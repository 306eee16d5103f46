"""The LM head once per chunk (issue 45): the training forward takes the logprobs AND the entropy from the same
chunk of logits, so the head (under ZeRO-3 an all-gather of its vocabulary x hidden matrix) runs once per chunk
in the forward and once more in the checkpoint's recompute for backward: 2 calls per chunk, not 3 (a second
forward only for the entropy). The entropy is checked against float64 at ZeRO stages 0, 2 and 3 with micro-batches
and grad_accum 2, packed and padded, beside the float64 update (tests/test_microbatch.py's engines)."""
from __future__ import annotations

import pytest
import torch
from test_microbatch import check_update, config, dist, make_batch, sgd_engine  # noqa: F401  (dist: fixture)

from common.logprobs import forward_calls
from trainer.objective import microbatch
from trainer.objective.update import new_round, train_update


def float64_entropy(model, b, cfg) -> float:
    """Masked mean entropy of the batch's completion-token distributions, float64, full logits."""
    L = b.input_ids.shape[1]
    att = (torch.arange(L)[None] < (b.prompt_lens + b.completion_lens)[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=b.input_ids, attention_mask=att).logits.double(), -1)
    T = int(b.completion_lens.max())
    mask = torch.arange(T)[None] < b.completion_lens[:, None]
    pos = (b.prompt_lens[:, None] + torch.arange(T)[None]).clamp(max=L - 1)
    ent = -(logp.exp() * logp).sum(-1).gather(1, pos - 1)
    return float((ent * mask).sum() / mask.sum())


@pytest.mark.parametrize("padding_free", ["true", "false"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_entropy_from_the_same_logits_matches_float64(dist, stage, padding_free):  # noqa: F811
    from common.modeling import load_model
    cfg = config("seq_mean", "token", grad_accum=2, padding_free=padding_free)
    eng = sgd_engine(dist, stage, grad_accum=2, gradient_checkpointing=True)
    batches = [make_batch(eng.module.config.vocab_size, seed) for seed in (1, 2)]
    ref = load_model(cfg.model, device="cpu", dtype="float32").double()
    named = list(eng.module.named_parameters())
    with dist.zero.GatheredParameters([p for _, p in named], enabled=hasattr(named[0][1], "ds_id")):
        ref.load_state_dict({n: p.detach().double() for n, p in named}, strict=False)
    want = sum(float64_entropy(ref, b, cfg) for b in batches) / len(batches)  # train_update: mean over batches
    calls = []
    hook = eng.module.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        stats = check_update(dist, eng, batches, cfg, lambda: train_update(eng, new_round(batches, cfg, "cpu"), cfg))
    finally:
        hook.remove()
    assert abs(stats["entropy"] - want) <= 1e-5 * max(1.0, abs(want))
    packed = padding_free == "true"
    chunks = 0
    for b in batches:  # each micro-batch's forwards x head calls per forward (the rows as update.py splits them)
        mask = b.completion_mask()
        for mb in microbatch.split(b, mask, b.advantages, None, None, 3, "seq_mean", by_length=not packed):
            packs, per = forward_calls(mb.prompt_lens, mb.completion_lens, cfg.logp_chunk_tokens, packed,
                                       cfg.pack_tokens)
            chunks += packs * per
    assert len(calls) == 2 * chunks  # forward + the checkpoint's recompute; no third call for the entropy
