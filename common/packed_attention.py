"""Attention confined to each packed row WITHOUT an N x N mask over the whole pack (issue 45).

transformers builds, for a packed sequence (position_ids restarting at 0, attention_mask None), a dense
block-diagonal N x N mask for sdpa/eager: attention over the whole pack, N^2 work where the rows cost sum(l_i^2)
(32 rows of ~45 tokens: 32x the attention of the padded batch). Instead, a model on sdpa is switched (once, in
place) to the attention implementation `packed_sdpa` registered here:

    no `pack_lens` kwarg   exactly transformers' sdpa (generation, padded forwards: the same masks, the same calls)
    `pack_lens` given      the packed forward of common/logprobs.py: no mask is built (the model gets a mask mapping
                           of None, so create_causal_mask never runs) and attention runs per row:
        segments  (CPU)    one causal sdpa call per row (sum l_i^2 work, torch's fused CPU kernel), GQA in-kernel
        rows      (CPU)    the pack's q/k/v gathered into (rows, longest) and ONE masked sdpa call: the padded
                           batch's attention (rows x longest^2) without its per-row calls; the linear layers and
                           the head still see only real tokens. Chosen per pack when cheaper than segments
                           (many short rows: the per-call cost, SEGMENT_CALL_FLOPS, dominates)
        flex      (CUDA)   flex_attention with a block mask of the rows (block-sparse: blocks of other rows skipped)
    `pack_parents` given   rows sharing a prompt (common/packing.py): a segment with a parent attends to all of the
                           parent's keys and causally to its own, in each kernel (per-segment calls with that mask;
                           rows: each child gathered after its parent; flex: the parent's blocks in the mask)

On CPU, a training forward (grad) in bf16/fp16 over rows of at most MATH_MAX_LEN tokens, without grouped-query
attention, runs sdpa's math kernel, packed or not: there it is faster than torch's fused CPU kernel, whose backward
in reduced precision is slow on short rows (see MATH_MAX_LEN; bench/packing.py --dtype bfloat16).

flash_attention_2/3 models need none of this: transformers calls the varlen kernel with cu_seqlens from the
restarting position_ids (modeling_flash_attention_utils), and `packed_kernel` says `native`. Under gradient
checkpointing the layers' recompute reads the same config and gets the same kwargs, so it runs the same kernel.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_SDPA = "packed_sdpa"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")
KERNELS = ("segments", "rows", "flex")
# one per-row attention call (forward + backward) on CPU, in multiply-adds of the same time: ~40 us at ~25 GFLOP/s
SEGMENT_CALL_FLOPS = 1.0e6
# Training forwards on CPU in bf16/fp16 over rows up to this long, in models without grouped-query attention, run
# sdpa's math kernel: the fused (flash) CPU kernel's backward in reduced precision costs ~3x the math kernel's on
# short rows (fwd + bwd of one call, bf16, 1 thread, 4 heads x 32: 32 rows x 62 tokens 22.6 vs 7.3 ms, x 128 tokens
# 24 vs 15 ms, x 256 tokens: fused 1.6x faster); the demo's whole train step: 9-13 % less CPU, padded and packed
# (bench/packing.py --dtype bfloat16). With GQA (Qwen2.5-0.5B's 14:2 heads) the math kernel was 7 % slower padded
# (6-11 % faster packed): those models keep the fused kernel, as do float32 and forwards without grad (scoring,
# pi_old, generation), where it is the faster one at every length measured.
MATH_MAX_LEN = 128
FORCE_KERNEL: str | None = None  # tests: run the CUDA kernel (flex) on CPU, where flex_attention runs un-compiled
_compiled_flex = None
SHARE_PROMPTS = True  # rows with the same prompt share its tokens in a pack (shares_prompts); False: tests' reference


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                pack_lens=None, pack_kernel="segments", pack_block_mask=None, pack_rows=None, pack_parents=None,
                **kwargs):
    """transformers' sdpa, or (pack_lens given) attention within each of the rows packed along the sequence."""
    if pack_lens is None:
        with _kernel(query, key, query.shape[2]):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, sliding_window=sliding_window, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("a packed forward takes one packed sequence and no attention mask")
    drop = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    if pack_parents is not None and sliding_window is not None and \
            max(_row_lens(pack_lens, pack_parents)) > sliding_window:
        raise ValueError("a shared-prompt pack over rows longer than the sliding window (pack with "
                         "share_prompts only for full-attention models: packing.shares_prompts)")
    if pack_kernel == "flex":
        out = _flex()(query, key, value, block_mask=pack_block_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    longest = max(_row_lens(pack_lens, pack_parents))
    if pack_kernel == "rows" and (sliding_window is None or longest <= sliding_window):
        with _kernel(query, key, longest):
            return _rows_attention(query, key, value, pack_rows, drop, scaling, gqa), None
    with _kernel(query, key, longest):
        if pack_parents is not None:
            return _tree_segments_attention(query, key, value, pack_lens, pack_parents, drop, scaling, gqa), None
        return _segments_attention(query, key, value, pack_lens, drop, scaling, sliding_window, gqa), None


def _row_lens(lens, parents) -> list[int]:
    """Each segment's attention span: its own length, plus its parent's where it has one."""
    if parents is None:
        return list(lens)
    return [n + (lens[p] if p >= 0 else 0) for n, p in zip(lens, parents)]


def _tree_segments_attention(query, key, value, lens, parents, drop, scaling, gqa):
    """One sdpa call per segment of the (1, H, N, D) pack -> (1, N, H, D): causal within it, and over all of its
    parent segment's keys first where it has one (a shared prompt)."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    outs = []
    for s, n, p in zip(starts, lens, parents):
        q, k, v = query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n]
        if p < 0:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=drop, scale=scaling, enable_gqa=gqa))
            continue
        ps, pn = starts[p], lens[p]
        k = torch.cat([key[:, :, ps:ps + pn], k], dim=2)
        v = torch.cat([value[:, :, ps:ps + pn], v], dim=2)
        i = torch.arange(n, device=query.device)
        own = i[None, :] <= i[:, None]
        mask = torch.cat([torch.ones(n, pn, dtype=torch.bool, device=query.device), own], dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=drop, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _kernel(query: torch.Tensor, key: torch.Tensor, longest: int):
    """sdpa's math kernel where it is the faster one (MATH_MAX_LEN), else torch's own choice."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and query.requires_grad \
            and longest <= MATH_MAX_LEN and query.shape[1] == key.shape[1]:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _segments_attention(query, key, value, pack_lens, drop, scaling, sliding_window, gqa):
    """One causal sdpa call per row of the (1, H, N, D) pack -> (1, N, H, D)."""
    outs, s = [], 0
    for n in pack_lens:
        q, k, v = query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n]
        if sliding_window is not None and n > sliding_window:  # a band of the last sliding_window keys
            i = torch.arange(n, device=query.device)
            band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=band, dropout_p=drop, scale=scaling, enable_gqa=gqa))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=drop, scale=scaling, enable_gqa=gqa))
        s += n
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _rows_attention(query, key, value, rows, drop, scaling, gqa):
    """(1, H, N, D) packed -> (B, H, longest, D) rows through one masked sdpa call -> (1, N, H, D) packed."""
    # (B, longest) packed position of each row's column, (B, 1, L, L) mask, (N,) where each packed position's
    # output is in the flat (B * longest) rows (a shared prompt's: in its first child's row)
    index, mask, real = rows
    B, L = index.shape

    def to_rows(x):
        return x[0][:, index.reshape(-1)].reshape(x.shape[1], B, L, x.shape[-1]).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(to_rows(query), to_rows(key), to_rows(value),
                                                           attn_mask=mask, dropout_p=drop, scale=scaling,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2).reshape(B * L, out.shape[1], out.shape[-1])[real][None]


def _rows_plan(lens: list[int], device: torch.device, parents: list[int] | None = None):
    if parents is not None:
        return _tree_rows_plan(lens, parents, device)
    lt = torch.tensor(lens, device=device)
    L = int(lt.max())
    col = torch.arange(L, device=device)
    valid = col[None, :] < lt[:, None]
    index = torch.where(valid, (torch.cumsum(lt, 0) - lt)[:, None] + col[None, :], 0)
    mask = (col[None, :] <= col[:, None])[None] & valid[:, None, :]  # causal, keys of the row only
    return index, mask[:, None], valid.reshape(-1).nonzero().squeeze(1)


def _tree_rows_plan(lens: list[int], parents: list[int], device: torch.device):
    """_rows_plan of a shared-prompt pack: a row per segment nobody's parent, its parent's positions first; each
    packed position's output taken from one row that holds it (a prompt's from its first child)."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    is_parent = set(p for p in parents if p >= 0)
    rows = []
    for i, p in enumerate(parents):
        if i in is_parent:
            continue
        own = list(range(starts[i], starts[i] + lens[i]))
        rows.append((list(range(starts[p], starts[p] + lens[p])) if p >= 0 else []) + own)
    L = max(len(r) for r in rows)
    take = [0] * sum(lens)
    seen = [False] * sum(lens)
    for b, r in enumerate(rows):
        for c, at in enumerate(r):
            if not seen[at]:
                take[at], seen[at] = b * L + c, True
    lt = torch.tensor([len(r) for r in rows], device=device)
    col = torch.arange(L, device=device)
    valid = col[None, :] < lt[:, None]
    index = torch.tensor([r + [0] * (L - len(r)) for r in rows], dtype=torch.long, device=device)
    mask = (col[None, :] <= col[:, None])[None] & valid[:, None, :]
    return index, mask[:, None], torch.tensor(take, dtype=torch.long, device=device)


def cpu_kernel(lens: list[int], pair_flops: float, layers: int = 1) -> tuple[str, float]:
    """The cheaper CPU kernel for a pack of these row lengths and its attention work (per_pair: multiply-adds
    per (query, key) pair over all layers): per-row calls, or one padded call."""
    segments = sum(n * n for n in lens) * pair_flops + len(lens) * layers * SEGMENT_CALL_FLOPS
    rows = len(lens) * max(lens) ** 2 * pair_flops + layers * SEGMENT_CALL_FLOPS
    return ("segments", segments) if segments <= rows else ("rows", rows)


AttentionInterface.register(PACKED_SDPA, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # unpacked calls: sdpa's own masks


def _flex():
    """flex_attention: compiled on CUDA (the block-sparse kernel), as is on CPU (its reference implementation,
    for tests of this path)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if not torch.cuda.is_available():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def packed_kernel(model: torch.nn.Module) -> str | None:
    """How a packed forward of this model confines attention: native (flash varlen), segments (CPU), flex
    (CUDA), or None: its attention implementation has no packed kernel here (eager: transformers' dense mask)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in NATIVE_VARLEN:
        return "native"
    if impl not in ("sdpa", PACKED_SDPA):
        return None
    if FORCE_KERNEL is not None:
        return FORCE_KERNEL
    return "segments" if next(model.parameters()).device.type == "cpu" else "flex"


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether a packed forward of this model packs a shared prompt once (common/packing.py): where its packed
    kernel is one of ours (segments / rows / flex; flash varlen and eager masks cannot say "this row also sees
    that prompt") and every layer attends in full (a sliding window would need the band across the two
    segments). SHARE_PROMPTS False: never (tests compare both layouts)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    full = all(t == "full_attention" for t in (getattr(c, "layer_types", None) or ["full_attention"]))
    return SHARE_PROMPTS and full and packed_kernel(model) in ("segments", "rows", "flex")


def install(model: torch.nn.Module) -> None:
    """Switch an sdpa model to packed_sdpa (identical outside packed forwards); idempotent."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.config._attn_implementation = PACKED_SDPA


def packed_call_kwargs(model: torch.nn.Module, lens: list[int], device: torch.device,
                       parents: list[int] | None = None) -> dict:
    """Extra arguments of the body's packed forward: none for flash varlen and eager (transformers' own handling),
    else no mask and the rows' lengths (and flex's block mask, built once per forward, not per layer); parents:
    a shared-prompt pack's (common/packing.py), for the kernels of shares_prompts only."""
    kernel = packed_kernel(model)
    if kernel in ("native", None):
        if parents is not None:
            raise ValueError(f"a shared-prompt pack needs a packed kernel of ours; this model's is {kernel}")
        return {}
    install(model)
    if kernel == "segments" and FORCE_KERNEL is None:
        c = model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kernel = cpu_kernel(_row_lens(lens, parents), 4 * c.num_attention_heads * hd)[0]
    kw: dict = {"attention_mask": defaultdict(lambda: None), "pack_lens": tuple(lens), "pack_kernel": kernel}
    if parents is not None:
        kw["pack_parents"] = tuple(parents)
    if kernel == "rows":
        kw["pack_rows"] = _rows_plan(lens, device, parents)
    if kernel == "flex":
        kw["pack_block_mask"] = _block_mask(lens, device, parents)
    return kw


def _block_mask(lens: list[int], device: torch.device, parents: list[int] | None = None):
    from torch.nn.attention.flex_attention import create_block_mask
    seg = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    n = int(sum(lens))
    if parents is None:
        def same_row_causal(b, h, q, k):
            return (seg[q] == seg[k]) & (k <= q)
        return create_block_mask(same_row_causal, 1, None, n, n, device=device)
    parent = torch.tensor(parents, device=device)[seg]  # per position: its segment's parent (-1 none)

    def row_or_parent(b, h, q, k):
        return ((seg[q] == seg[k]) & (k <= q)) | (parent[q] == seg[k])
    return create_block_mask(row_or_parent, 1, None, n, n, device=device)
