"""Padding-free forwards (common/packing.py, issue 33): a micro-batch's rows as one packed sequence give the padded
forward's per-token logprobs, entropies and gradients within float32 rounding, on the tiny model and on a random
model with Qwen2.5-0.5B's shapes (hidden 896, 14 heads, 2 KV heads, MLP 4,864, vocabulary 151,936), and attention
never crosses from one packed row into another."""
from __future__ import annotations

import contextlib

import pytest
import torch

from common.logprobs import head_calls, sequence_logprobs
from common.pack_choice import choose_packed, work
from common.packing import check_packed_attention, forward_tokens, pack_rows, row_groups

PROMPT_LENS = [3, 9, 1, 5, 2]
COMPLETION_LENS = [6, 2, 11, 1, 8]


@pytest.fixture(scope="module")
def tiny():
    from common.modeling import load_model, resolve_model_path
    return load_model(resolve_model_path("tiny"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen_shaped():
    """Qwen2.5-0.5B's attention and MLP shapes, GQA 7:1, rope theta 1e6, tied 151,936-row embedding; 2 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    conf = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                       num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, tie_word_embeddings=True)
    return Qwen2ForCausalLM(conf).eval().requires_grad_(False)


def rows(vocab: int, seed: int = 0, pad: int = 3):
    g = torch.Generator().manual_seed(seed)
    pl, cl = torch.tensor(PROMPT_LENS), torch.tensor(COMPLETION_LENS)
    ids = torch.randint(0, vocab, (len(pl), int((pl + cl).max()) + pad), generator=g)  # junk past each row
    return ids, pl, cl


def test_pack_rows_layout():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    p = pack_rows(ids, torch.tensor([1, 1, 2]), torch.tensor([2, 1, 2]))
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert p.pred.tolist() == [0, 1, 3, 6, 7]  # the packed position before each completion token
    assert p.targets.tolist() == [6, 7, 9, 3, 4]
    assert p.rows.tolist() == [0, 0, 1, 2, 2] and p.cols.tolist() == [0, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="no prompt token"):
        pack_rows(ids, torch.tensor([0, 1, 1]), torch.tensor([2, 1, 1]))


@pytest.mark.parametrize("which", ["tiny", "qwen_shaped"])
def test_packed_logprobs_equal_padded(request, which):
    model = request.getfixturevalue(which)
    ids, pl, cl = rows(model.config.vocab_size)
    with torch.no_grad():
        want, want_ent = sequence_logprobs(model, ids, pl, cl, chunk_tokens=7, with_entropy=True)
        got, ent = sequence_logprobs(model, ids, pl, cl, chunk_tokens=7, with_entropy=True, padding_free=True)
    assert got.shape == want.shape == (len(pl), max(COMPLETION_LENS)) and got.dtype == torch.float32
    valid = torch.arange(got.shape[1])[None] < cl[:, None]
    assert (got[~valid] == 0).all() and (ent[~valid] == 0).all()
    assert float((got - want).abs().max()) <= 2e-5
    assert float((ent - want_ent).abs().max()) <= 1e-4


def test_packed_rows_do_not_see_each_other(qwen_shaped):
    """Row 1's logprobs do not move when row 0's tokens change; one causal sequence without the restarting
    position_ids (what a packed forward without a confining mask computes) would move them."""
    model = qwen_shaped
    ids, pl, cl = rows(model.config.vocab_size)
    other = ids.clone()
    other[0, :int(pl[0] + cl[0])] = (other[0, :int(pl[0] + cl[0])] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, _ = sequence_logprobs(model, ids, pl, cl, padding_free=True)
        b, _ = sequence_logprobs(model, other, pl, cl, padding_free=True)
        assert float((a[1:] - b[1:]).abs().max()) <= 1e-6
        p = pack_rows(ids, pl, cl)
        leaky = model(input_ids=p.input_ids).logits.log_softmax(-1)[0, p.pred, p.targets]
    assert float((leaky[p.rows == 1] - a[1, :int(cl[1])]).abs().max()) > 1e-3


def test_packed_gradient_equals_padded(tiny):
    model = tiny
    ids, pl, cl = rows(model.config.vocab_size, seed=1)
    weights = torch.randn(len(pl), max(COMPLETION_LENS), generator=torch.Generator().manual_seed(2))
    grads = []
    model.requires_grad_(True)
    try:
        for packed in (False, True):
            model.zero_grad()
            logps, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=5, padding_free=packed)
            (logps * weights).sum().backward()
            grads.append({n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None})
    finally:
        model.requires_grad_(False)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-5 * float(grads[0][n].abs().max()))


def test_packed_head_calls_and_min_chunks(tiny):
    """A packed forward calls the head once per chunk of the summed completion lengths; more calls (ZeRO-3 ranks
    agreeing on the maximum) are empty and change nothing."""
    model = tiny
    ids, pl, cl = rows(model.config.vocab_size)
    n = head_calls(cl, 8, padding_free=True)
    assert n == -(-int(cl.sum()) // 8) and head_calls(cl, 8) == -(-max(COMPLETION_LENS) // (8 // len(pl)))
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            a, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=8, padding_free=True)
            assert len(calls) == n
            b, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=8, padding_free=True, min_chunks=n + 3)
            assert len(calls) == 2 * n + 3
    finally:
        hook.remove()
    assert torch.equal(a, b)


def test_row_groups_and_token_counts():
    lens = torch.tensor([50, 10, 40, 12, 11])
    packed = row_groups(lens, 64, packed=True)
    assert [g.tolist() for g in packed] == [[0, 1], [2, 3, 4]]  # in order, at most 64 real tokens each
    padded = row_groups(lens, 64, packed=False)
    assert [g.tolist() for g in padded] == [[1, 4, 3], [2], [0]]  # by length, rows x longest <= 64
    assert [g.tolist() for g in row_groups(lens, 1, packed=True)] == [[i] for i in range(5)]  # one row at least
    pl, cl = torch.tensor([2, 2]), torch.tensor([6, 2])
    assert forward_tokens(pl, cl, packed=False) == (16, 12) and forward_tokens(pl, cl, packed=True) == (12, 12)


def test_padding_free_knob(tiny):
    from common.config import GRPOConfig
    from ref_server.config import ServerConfig
    pl, cl = torch.tensor(PROMPT_LENS), torch.tensor(COMPLETION_LENS)
    assert choose_packed(True, tiny, pl, cl, 5) is True and choose_packed("false", tiny, pl, cl, 5) is False
    with pytest.raises(ValueError, match="padding_free"):
        choose_packed("sometimes", tiny, pl, cl, 5)
    with pytest.raises(ValueError, match="padding_free"):
        GRPOConfig(padding_free="sometimes").validate()
    with pytest.raises(ValueError, match="padding_free"):
        ServerConfig(model="tiny", padding_free="sometimes").validate()
    assert GRPOConfig(padding_free=False).validate().padding_free is False
    impl = tiny.config._attn_implementation
    try:
        tiny.config._attn_implementation = "paged|sdpa"
        with pytest.raises(ValueError, match="padding_free"):
            check_packed_attention(tiny)
    finally:
        tiny.config._attn_implementation = impl


@pytest.mark.parametrize("kernel", ["segments", "rows", "flex"])
def test_packed_attention_kernels_equal_padded_without_a_pack_wide_mask(qwen_shaped, kernel, monkeypatch):
    """The packed kernels (common/packed_attention.py: per-row sdpa and one padded call over the pack's rows, CPU's;
    flex_attention's block mask, CUDA's, here un-compiled) give the padded logprobs, and no attention call spans
    the pack: the longest query any attention call sees is one row (the dense-mask path attended over all
    sum(lens) tokens at once)."""
    from common import packed_attention
    model = qwen_shaped
    monkeypatch.setattr(packed_attention, "FORCE_KERNEL", kernel)
    ids, pl, cl = rows(model.config.vocab_size)
    widest = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: widest.append(q.shape[-2]) or real_sdpa(q, *a, **k))
    with torch.no_grad():
        want, _ = sequence_logprobs(model, ids, pl, cl)
        widest.clear()
        got, _ = sequence_logprobs(model, ids, pl, cl, padding_free=True)
    assert model.config._attn_implementation == packed_attention.PACKED_SDPA
    assert float((got - want).abs().max()) <= 2e-5
    if kernel != "flex":
        assert widest and max(widest) <= int((pl + cl).max())
    else:
        assert not widest  # flex_attention, no sdpa call at all


def test_auto_packs_ragged_rows_and_pads_uniform_ones(tiny, qwen_shaped):
    """auto (common/pack_choice.py): ragged rows pack (padding saved > the per-row attention calls), equal-length
    rows pad (nothing to save); the ranks' summed estimates decide alike (reduce)."""
    ragged_p, ragged_c = torch.full((32,), 30), torch.tensor([4, 32] * 16)
    even_p, even_c = torch.full((32,), 30), torch.full((32,), 16)
    for model in (tiny, qwen_shaped):
        assert choose_packed("auto", model, ragged_p, ragged_c, 32) is True
        assert choose_packed("auto", model, even_p, even_c, 32) is False
        packed, padded = work(model, even_p, even_c, 32, 4096)
        assert packed > padded  # the same tokens plus the per-row calls
    seen = []
    assert choose_packed("auto", tiny, even_p, even_c, 32, reduce=lambda t: seen.append(t) or t.mul_(0).add_(
        torch.tensor([1.0, 2.0], dtype=torch.float64))) is True  # the other ranks' work tipped it
    assert len(seen) == 1


def test_packed_sdpa_is_sdpa_outside_packed_forwards():
    """The model switched to packed_sdpa (on its first packed forward) generates and scores padded rows exactly as
    with sdpa: the HF engine generates with the same model its logprob pass packs."""
    from common import packed_attention
    from common.modeling import load_model, resolve_model_path
    model = load_model(resolve_model_path("tiny"), device="cpu", dtype="float32")
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    att = (ids != 0).long()

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=8, do_sample=False, pad_token_id=0)
            return out, model(input_ids=ids, attention_mask=att).logits
    want = run()
    packed_attention.install(model)
    assert model.config._attn_implementation == packed_attention.PACKED_SDPA
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _attention_nodes(t: torch.Tensor) -> set[str]:
    """Names of the sdpa backward nodes in t's autograd graph."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if "Attention" in type(f).__name__:
            names.add(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return names


@pytest.mark.parametrize("packed,kernel", [(False, None), (True, "segments"), (True, "rows")])
def test_bf16_training_on_cpu_runs_the_math_kernel_on_short_rows(packed, kernel, monkeypatch):
    """Training forwards on CPU in bf16 over rows up to MATH_MAX_LEN run sdpa's math kernel (the fused CPU kernel's
    bf16 backward is ~3x slower there: bench/packing.py --dtype bfloat16), padded and packed alike, with the
    fused kernel's logprobs and gradient within bf16 rounding; float32 and longer rows keep the fused kernel."""
    from common import packed_attention
    from common.modeling import load_model, resolve_model_path
    if kernel is not None:
        monkeypatch.setattr(packed_attention, "FORCE_KERNEL", kernel)
    model = load_model(resolve_model_path("tiny"), device="cpu", dtype="bfloat16").requires_grad_(True)
    ids, pl, cl = rows(model.config.vocab_size, seed=3)
    weights = torch.randn(len(pl), max(COMPLETION_LENS), generator=torch.Generator().manual_seed(4))
    default = packed_attention.MATH_MAX_LEN
    assert default >= int((pl + cl).max())

    def step(math_max_len: int):
        monkeypatch.setattr(packed_attention, "MATH_MAX_LEN", math_max_len)
        model.zero_grad()
        logps, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=5, padding_free=packed)
        nodes = _attention_nodes(logps)
        (logps * weights).sum().backward()
        return logps.detach(), {n: q.grad.float().clone() for n, q in model.named_parameters()}, nodes

    fused = step(0)
    math = step(default)
    assert fused[2] == {"ScaledDotProductFlashAttentionForCpuBackward0"}
    assert not math[2]  # the math kernel: matmuls and a softmax, no fused-attention node
    assert float((math[0] - fused[0]).abs().max()) <= 0.1  # logprobs from bf16 activations
    for n, g in fused[1].items():
        assert float((math[1][n] - g).norm()) <= 0.05 * float(g.norm()) + 1e-6, n
    assert step(int((pl + cl).max()) - 1)[2] == {"ScaledDotProductFlashAttentionForCpuBackward0"}  # a longer row
    model.float()
    assert step(default)[2] == {"ScaledDotProductFlashAttentionForCpuBackward0"}
    q = torch.zeros(1, 4, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    assert not isinstance(packed_attention._kernel(q, q, 8), contextlib.nullcontext)
    assert isinstance(packed_attention._kernel(q, q[:, :2], 8), contextlib.nullcontext)  # GQA: the fused kernel
