"""Rows sharing a prompt share its tokens in a packed forward (common/packing.py, issue 62): the logprobs, entropies
and gradients of the shared layout equal the rows packed apart (and padded) in float64, on every packed kernel
(per-segment calls, one padded call, flex), and a row never sees another row's completion."""
from __future__ import annotations

import contextlib

import pytest
import torch

from common import packed_attention
from common.logprobs import sequence_logprobs
from common.packing import pack_rows

# three prompts shared by 3, 2 and 2 rows, and one row with a prompt of its own; completions of varied lengths
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16]]
LAYOUT = [(0, 6), (0, 2), (0, 9), (1, 1), (1, 5), (3, 4), (2, 3), (2, 7)]


@pytest.fixture(scope="module")
def tiny64():
    from common.modeling import load_model, resolve_model_path
    return load_model(resolve_model_path("tiny"), device="cpu", dtype="float32").double()


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = PROMPTS + [[20, 21, 22]]
    pl = torch.tensor([len(prompts[p]) for p, _ in LAYOUT])
    cl = torch.tensor([c for _, c in LAYOUT])
    ids = torch.randint(30, vocab, (len(LAYOUT), int((pl + cl).max()) + 2), generator=g)  # junk past each row
    for r, (p, _) in enumerate(LAYOUT):
        ids[r, :len(prompts[p])] = torch.tensor(prompts[p])
    return ids, pl, cl


@contextlib.contextmanager
def settings(share: bool, kernel: str | None):
    old = packed_attention.SHARE_PROMPTS, packed_attention.FORCE_KERNEL
    packed_attention.SHARE_PROMPTS, packed_attention.FORCE_KERNEL = share, kernel
    try:
        yield
    finally:
        packed_attention.SHARE_PROMPTS, packed_attention.FORCE_KERNEL = old


def test_shared_layout():
    ids = torch.tensor([[1, 2, 7, 8, 0], [1, 2, 9, 0, 0], [3, 4, 5, 6, 0]])
    p = pack_rows(ids, torch.tensor([2, 2, 2]), torch.tensor([2, 1, 2]), share_prompts=True)
    assert p.input_ids.tolist() == [[1, 2, 7, 8, 9, 3, 4, 5, 6]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3]]  # each completion at its row's positions
    assert p.lens == [2, 2, 1, 4] and p.parents == [-1, 0, 0, -1]
    assert p.pred.tolist() == [1, 2, 1, 6, 7]  # both rows' first tokens from the prompt's last state
    assert p.targets.tolist() == [7, 8, 9, 5, 6]
    assert p.rows.tolist() == [0, 0, 1, 2, 2] and p.cols.tolist() == [0, 1, 0, 0, 1]
    alone = pack_rows(ids[2:], torch.tensor([2]), torch.tensor([2]), share_prompts=True)
    assert alone.parents is None and alone.lens == [4]  # nothing shared: the plain layout


def run(model, ids, pl, cl, share, kernel, weights):
    model.zero_grad()
    grad = kernel != "flex"  # flex_attention has no backward on CPU (on CUDA it is compiled): forward only there
    with settings(share, kernel), torch.set_grad_enabled(grad):
        logps, ent = sequence_logprobs(model, ids, pl, cl, chunk_tokens=5, with_entropy=True, padding_free=True,
                                       pack_tokens=40)
    if not grad:
        return logps, ent, {}
    ((logps * weights).sum() + ent.sum()).backward()
    return logps.detach(), ent.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["segments", "rows", "flex"])
def test_shared_prompts_equal_rows_apart_in_float64(tiny64, kernel):
    """pack_tokens 40 splits a group across two packs (each packs its own copy of the prompt)."""
    ids, pl, cl = batch(tiny64.config.vocab_size)
    weights = torch.randn(len(LAYOUT), int(cl.max()), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tiny64.requires_grad_(True)
    try:
        want = run(tiny64, ids, pl, cl, False, kernel, weights)
        got = run(tiny64, ids, pl, cl, True, kernel, weights)
        with torch.no_grad():
            padded, _ = sequence_logprobs(tiny64, ids, pl, cl)
    finally:
        tiny64.requires_grad_(False)
    assert float((got[0] - want[0]).abs().max()) <= 1e-6  # the head's float32 log-softmax bounds the agreement
    assert float((got[0] - padded).abs().max()) <= 1e-6
    assert float((got[1] - want[1]).abs().max()) <= 1e-5
    assert want[2] or kernel == "flex"
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=n)


def test_the_path_is_taken_and_rows_stay_apart(tiny64):
    """The shared layout runs (fewer tokens through the body) and a row's logprobs do not move when a sibling's
    completion changes, but do when their shared prompt changes."""
    ids, pl, cl = batch(tiny64.config.vocab_size)
    seen = []
    hook = tiny64.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]),
                                                  with_kwargs=True)
    try:
        with torch.no_grad():
            a, _ = sequence_logprobs(tiny64, ids, pl, cl, padding_free=True)
            sib = ids.clone()
            sib[1, 4:6] = (sib[1, 4:6] + 1) % tiny64.config.vocab_size  # row 1's completion, same prompt as row 0
            b, _ = sequence_logprobs(tiny64, sib, pl, cl, padding_free=True)
            pro = ids.clone()
            pro[:3, 1] = (pro[:3, 1] + 1) % tiny64.config.vocab_size  # the prompt rows 0-2 share
            c, _ = sequence_logprobs(tiny64, pro, pl, cl, padding_free=True)
    finally:
        hook.remove()
    shared = sum(len(p) for p in PROMPTS) + 3 + int(cl.sum())
    assert seen[0] == shared < int((pl + cl).sum())
    assert float((a[[0, 2]] - b[[0, 2]]).abs().max()) == 0.0 and float((a[1] - b[1]).abs().max()) > 1e-3
    assert float((a[:3] - c[:3]).abs().max()) > 1e-3 and float((a[3:] - c[3:]).abs().max()) == 0.0


def test_only_kernels_that_can_share(tiny64):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    assert packed_attention.shares_prompts(tiny64)
    eager = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager"))
    assert not packed_attention.shares_prompts(eager)  # transformers' mask from position_ids cannot express it
    windowed = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True,
                                            sliding_window=8, max_window_layers=1))
    assert not packed_attention.shares_prompts(windowed)
