"""common.logprobs against independent float64 re-derivations (values, entropy, gradients, layouts)."""
from __future__ import annotations

import pytest
import torch

import common.logprobs as lp
from common.logprobs import (
    attention_mask_from_lengths,
    completion_index,
    logprobs_from_hidden,
    logprobs_from_logits,
    sequence_logprobs,
)


def ref_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.double().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def ref_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.double().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


# --- logprobs_from_logits ---------------------------------------------------------------
@pytest.mark.parametrize("shape,scale", [((3, 11, 97), 1.0), ((2, 5, 1000), 8.0), ((7, 50), 30.0), ((64,), 3.0)])
def test_logprobs_from_logits_matches_float64(shape, scale):
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(*shape, generator=g) * scale
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    got = logprobs_from_logits(logits, targets)
    assert got.dtype == torch.float32 and got.shape == targets.shape
    assert (got.double() - ref_logps(logits, targets)).abs().max() < 1e-5
    assert (got <= 1e-6).all()


def test_logprobs_from_logits_upcasts_half_inputs():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 9, 300, generator=g) * 5).bfloat16()
    targets = torch.randint(0, 300, (4, 9), generator=g)
    got = logprobs_from_logits(logits, targets)
    assert got.dtype == torch.float32
    assert (got.double() - ref_logps(logits, targets)).abs().max() < 1e-5  # same bf16 values, exact math


# --- logprobs_from_hidden -------------------------------------------------------------------
def head_and_inputs(B=3, T=13, H=24, V=101, bias=False, seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(B, T, H, generator=g) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    return head, hidden, targets


def naive64(hidden, head, targets):
    logits = hidden.double() @ head.weight.double().T
    if head.bias is not None:
        logits = logits + head.bias.double()
    return logits


@pytest.mark.parametrize("chunk_tokens", [1, 7, 3 * 13, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_logprobs_from_hidden_matches_float64(chunk_tokens, bias):
    head, hidden, targets = head_and_inputs(bias=bias)
    with torch.no_grad():
        logps, ent = logprobs_from_hidden(hidden, head, targets, chunk_tokens=chunk_tokens, with_entropy=True)
    logits64 = naive64(hidden, head, targets)
    assert logps.shape == targets.shape and logps.dtype == torch.float32
    assert (logps.double() - ref_logps(logits64, targets)).abs().max() < 1e-5
    assert ent.shape == targets.shape
    assert (ent.double() - ref_entropy(logits64)).abs().max() < 1e-5
    _, none = logprobs_from_hidden(hidden, head, targets, chunk_tokens=chunk_tokens)
    assert none is None


def test_chunk_sizes_agree_exactly_enough():
    head, hidden, targets = head_and_inputs(B=2, T=33, V=257)
    with torch.no_grad():
        outs = [logprobs_from_hidden(hidden, head, targets, chunk_tokens=c)[0] for c in (1, 2, 7, 64, 100_000)]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk_tokens", [1, 7, 10_000])
def test_gradient_through_checkpointed_path_matches_float64(chunk_tokens, monkeypatch):
    head, hidden, targets = head_and_inputs(B=3, T=17, H=16, V=61, bias=True, seed=3)
    hidden.requires_grad_(True)
    w = torch.randn(targets.shape, generator=torch.Generator().manual_seed(9))  # arbitrary per-token loss weights

    calls = []
    real_checkpoint = lp.checkpoint
    monkeypatch.setattr(lp, "checkpoint", lambda *a, **k: calls.append(1) or real_checkpoint(*a, **k))
    logps, _ = logprobs_from_hidden(hidden, head, targets, chunk_tokens=chunk_tokens)
    step = max(1, chunk_tokens // 3)
    assert len(calls) == -(-17 // step)  # every chunk went through checkpoint (recomputed in backward)
    params = [hidden, head.weight, head.bias]
    got = torch.autograd.grad((logps * w).sum(), params)

    # The naive formula in float64 on float64 copies of the same leaves.
    leaves64 = [p.detach().double().requires_grad_(True) for p in params]
    h64, W64, b64 = leaves64
    logits64 = h64 @ W64.T + b64
    ref = (logits64.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * w.double()).sum()
    want = torch.autograd.grad(ref, leaves64)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        assert g.shape == r.shape
        assert _rel(g, r) < 1e-6, (name, _rel(g, r))


def test_no_checkpoint_without_grad(monkeypatch):
    head, hidden, targets = head_and_inputs()
    head.requires_grad_(False)
    monkeypatch.setattr(lp, "checkpoint", lambda *a, **k: pytest.fail("checkpoint used without autograd"))
    logprobs_from_hidden(hidden, head, targets, chunk_tokens=5)
    head.requires_grad_(True)
    with torch.no_grad():
        logprobs_from_hidden(hidden, head, targets, chunk_tokens=5)


def test_completion_index_and_mask():
    pl, cl = torch.tensor([2, 5, 1]), torch.tensor([3, 1, 4])
    pos, valid = completion_index(pl, cl)
    assert pos.tolist() == [[2, 3, 4, 2], [5, 5, 5, 5], [1, 2, 3, 4]]
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False], [True] * 4]
    assert attention_mask_from_lengths(pl + cl, 6).tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6, [1, 1, 1, 1, 1, 0]]


# --- sequence_logprobs on the tiny Qwen2 model ----------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from common.modeling import load_model, load_tokenizer
    from common.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model())
    model = load_model(path, device="cpu", dtype="float32")
    return model, load_tokenizer(path)


PROMPT_LENS = [3, 9, 1, 5, 2]
COMPLETION_LENS = [6, 2, 11, 1, 8]


def right_padded(tok, pad_width=3, seed=0, pad_value=None):
    g = torch.Generator().manual_seed(seed)
    V = len(tok)
    pl, cl = torch.tensor(PROMPT_LENS), torch.tensor(COMPLETION_LENS)
    n = pl + cl
    L = int(n.max()) + pad_width
    ids = torch.full((len(pl), L), tok.pad_token_id if pad_value is None else 0, dtype=torch.int64)
    junk = torch.Generator().manual_seed(seed + 1000)  # separate stream: real tokens stay the same
    for i in range(len(pl)):
        ids[i, :n[i]] = torch.randint(0, V, (int(n[i]),), generator=g)
        if pad_value == "random":
            ids[i, n[i]:] = torch.randint(0, V, (L - int(n[i]),), generator=junk)
    return ids, pl, cl


def full_forward_reference(model, ids, pl, cl):
    """Direct full forward, float64 log-softmax, gathered at the completion positions (right padding)."""
    mask = (torch.arange(ids.shape[1])[None] < (pl + cl)[:, None]).long()
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
    out = torch.zeros(len(pl), int(cl.max()), dtype=torch.float64)
    ent = torch.zeros_like(out)
    for i in range(len(pl)):
        for j in range(int(cl[i])):
            p = int(pl[i]) + j
            out[i, j] = logp[i, p - 1, ids[i, p]]
            ent[i, j] = -(logp[i, p - 1].exp() * logp[i, p - 1]).sum()
    return out, ent


def test_sequence_logprobs_matches_full_forward(tiny):
    model, tok = tiny
    ids, pl, cl = right_padded(tok)
    with torch.no_grad():
        got, ent = sequence_logprobs(model, ids, pl, cl, chunk_tokens=16, with_entropy=True)
    want, want_ent = full_forward_reference(model, ids, pl, cl)
    assert got.shape == (len(pl), max(COMPLETION_LENS)) and got.dtype == torch.float32
    valid = torch.arange(got.shape[1])[None] < cl[:, None]
    assert (got.double() - want).abs().max() <= 1e-5
    assert (ent.double() - want_ent).abs().max() <= 1e-5
    assert (got[~valid] == 0).all() and (ent[~valid] == 0).all()  # padding entries are exactly 0
    assert (got[valid] < 0).all()


def test_sequence_logprobs_independent_of_chunking_and_pad_content(tiny):
    model, tok = tiny
    ids, pl, cl = right_padded(tok, seed=1)
    ids_junk, _, _ = right_padded(tok, seed=1, pad_value="random")
    assert not torch.equal(ids, ids_junk)
    with torch.no_grad():
        a, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=1)
        b, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=100_000)
        c, _ = sequence_logprobs(model, ids_junk, pl, cl, chunk_tokens=7)
    assert (a - b).abs().max() <= 1e-5 and (a - c).abs().max() <= 1e-5


def test_sequence_logprobs_equals_left_padded_generation_layout(tiny):
    """Generation pads on the left with HF position ids from the mask; the logprobs must agree."""
    model, tok = tiny
    ids, pl, cl = right_padded(tok, seed=2)
    B = len(pl)
    n = pl + cl
    L = int(n.max()) + 2
    left = torch.full((B, L), tok.pad_token_id, dtype=torch.int64)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i in range(B):
        left[i, L - n[i]:] = ids[i, :n[i]]
        mask[i, L - n[i]:] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logp = model(input_ids=left, attention_mask=mask, position_ids=position_ids).logits.double().log_softmax(-1)
        got, _ = sequence_logprobs(model, ids, pl, cl)
    want = torch.zeros(B, int(cl.max()), dtype=torch.float64)
    for i in range(B):
        start = L - int(n[i]) + int(pl[i])  # first completion token in the left-padded row
        for j in range(int(cl[i])):
            want[i, j] = logp[i, start + j - 1, left[i, start + j]]
    assert (got.double() - want).abs().max() <= 1e-5


def test_sequence_logprobs_gradient_flows_to_the_model(tiny):
    model, tok = tiny
    ids, pl, cl = right_padded(tok, seed=3)
    emb = model.get_input_embeddings().weight
    emb.requires_grad_(True)
    try:
        logps, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=8)
        (g,) = torch.autograd.grad(logps.sum(), [emb])
    finally:
        emb.requires_grad_(False)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_min_chunks_pads_with_empty_head_calls_and_changes_nothing():
    """ZeRO-3 ranks agree on the LM-head call count: extra calls are empty chunks, values and gradients unchanged."""
    from common.logprobs import chunk_count, logprobs_from_hidden
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    calls = []
    head.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    base, _ = logprobs_from_hidden(hidden, head, targets, chunk_tokens=4)
    (g_base,) = torch.autograd.grad(base.sum(), hidden)
    n = chunk_count(2, 7, 4)
    assert n == 4 and len(calls) == 2 * n  # forward + checkpoint recompute per chunk
    calls.clear()
    padded, ent = logprobs_from_hidden(hidden, head, targets, chunk_tokens=4, with_entropy=True, min_chunks=n + 3)
    (g_pad,) = torch.autograd.grad(padded.sum(), hidden)
    assert len([c for c in calls if c[1] == 0]) >= 3 and ent.shape == (2, 7)
    torch.testing.assert_close(padded, base)
    torch.testing.assert_close(g_pad, g_base)


# --- temperature in float32 (issue 30) -------------------------------------------------------
def test_bf16_head_divided_by_the_temperature_in_float32():
    """A bf16 head's logits at T = 0.9 against float64 math on the same bf16 logits: the division happens after
    the float32 upcast (as in vLLM's sampler), so the error is float32's (3e-6 here), not a bf16 quotient's
    (a logit near 30 moves by up to 0.06; dividing before the upcast, as before issue 30, errs by 0.12 here)."""
    T = 0.9
    torch.manual_seed(3)
    head = torch.nn.Linear(64, 1000, bias=False).bfloat16()
    hidden = (torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(4)) * 15).bfloat16()
    targets = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        bf16_logits = head(hidden)  # what the model's forward returns, and vLLM samples from
        got, ent = logprobs_from_hidden(hidden, head, targets, chunk_tokens=16, with_entropy=True,
                                        logit_fn=lp.logit_fn_for(head, T))
    assert bf16_logits.abs().max() > 16  # where a bf16 quotient rounds to a multiple of 1/8 or coarser
    want = bf16_logits.double() / T
    err = (got.double() - ref_logps(want, targets)).abs().max().item()
    bf16_quotient = ref_logps((bf16_logits / T).double(), targets)  # what dividing before the upcast gives
    print(f"max |logp error| at T={T}: {err:.2e} (dividing in bf16: "
          f"{(bf16_quotient - ref_logps(want, targets)).abs().max().item():.2e})")
    assert err < 2e-5
    assert (ent.double() - ref_entropy(want)).abs().max() < 2e-5
