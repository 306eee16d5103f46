"""Padding-free forwards: the rows of a (micro-)batch as ONE packed sequence, so the model computes only real
tokens (verl's remove-padding, OpenRLHF's packed samples).

    rows (B, L) right-padded          packed (1, N), N = sum of the rows' real lengths
    [p p c c c . . .]                 input_ids     [p p c c c | p c c | p p p c]
    [p c c . . . . .]        ->       position_ids  [0 1 2 3 4 | 0 1 2 | 0 1 2 3]
    [p p p c . . . .]

Attention stays within each row without an N x N mask over the pack (common/packed_attention.py): sdpa models
attend per row (CPU) or through flex_attention's block mask (CUDA); flash-attention models get the varlen kernel
from transformers (cu_seqlens from the restarting position_ids); only eager models fall back to transformers'
dense block-diagonal mask. Rotary embeddings take the restarting positions, so every row sees exactly the
positions it has when padded. Whether `auto` packs: common/pack_choice.py.

Only the LM head positions that predict a completion token are gathered from the packed hidden states, so the
head (the largest matmul of a small model: vocabulary x hidden per position) skips the padding too.

A packed forward is bounded (`pack_plan`): with a dense N x N mask (eager) one pack of a whole micro-batch costs
quadratically in its TOTAL length (32 rows of ~640 tokens: 87 s a step on CPU), and packs bound memory. Rows go into
packs of at most `pack_tokens` tokens (row_groups, the helper the ref server bounds its forwards with too), one
forward each, their outputs added into one (B, T) result: the same numbers as one pack, attention never crosses
a row anyway.

Rows that share a prompt (a group's n samples) can share its tokens too (`pack_rows(share_prompts=True)`, where the
attention kernel supports it, `shares_prompts`): the prompt goes into the pack once, each row's completion after it
as a segment whose `parent` is that prompt, attending to all of it and causally to itself, at the positions it has
in its own row; the state at the prompt's last token predicts every row's first completion token. The same numbers
as the rows packed apart, to float rounding (tests/test_packing.py, the float64 checks), with the prompt's linear
work done once a group: 34 % of the demo's tokens (13-token prompts, ~21-token completions, 8 a group).

    rows    [P P c c c] [P P d d] [Q e e]   ->   segments [P P | c c c | d d | Q e e]   parents [-1, 0, 0, -1]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# attention implementations whose masks / kernels confine attention to each packed row (see the docstring)
PACKED_ATTENTION = ("sdpa", "packed_sdpa", "eager", "flash_attention_2", "flash_attention_3")


@dataclass
class Packed:
    input_ids: torch.Tensor     # (1, N)
    position_ids: torch.Tensor  # (1, N), restarting at 0 for every row
    pred: torch.Tensor          # (K,) packed positions whose hidden state predicts a completion token, K = sum clens
    targets: torch.Tensor       # (K,) those completion tokens
    rows: torch.Tensor          # (K,) row of each completion token in the (B, T) output
    cols: torch.Tensor          # (K,) its column (index within the row's completion)
    lens: list[int]             # each segment's length in the pack (common/packed_attention.py attends within them)
    parents: list[int] | None = None  # per segment: the segment it also attends to in full (-1 none); None: no sharing


def pack_rows(input_ids: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor,
              share_prompts: bool = False) -> Packed:
    """Right-padded (B, L) rows of prompt_lens + completion_lens real tokens -> one packed sequence (rows with
    the same prompt sharing its tokens: share_prompts, see the module docstring)."""
    device = input_ids.device
    B, L = input_ids.shape
    lens = prompt_lens + completion_lens
    if bool((lens > L).any()) or bool((prompt_lens < 1).any()):
        raise ValueError(f"rows of {lens.tolist()} tokens (prompts {prompt_lens.tolist()}) do not fit width {L} "
                         f"or have no prompt token to predict the first completion token from")
    if share_prompts:
        shared = _shared_layout(input_ids, prompt_lens.tolist(), completion_lens.tolist())
        if shared is not None:
            return shared
    real = torch.arange(L, device=device)[None, :] < lens[:, None]
    starts = torch.cumsum(lens, 0) - lens  # where each row begins in the packed sequence
    positions = torch.arange(L, device=device)[None, :].expand(B, L)
    T = int(completion_lens.max()) if B else 0
    j = torch.arange(T, device=device)
    cmask = j[None, :] < completion_lens[:, None]
    rows, cols = cmask.nonzero(as_tuple=True)
    at = prompt_lens[rows] + cols  # position of the completion token within its row
    return Packed(input_ids=input_ids[real][None], position_ids=positions[real][None],
                  pred=starts[rows] + at - 1, targets=input_ids[rows, at], rows=rows, cols=cols,
                  lens=lens.tolist())


def _shared_layout(input_ids: torch.Tensor, plens: list[int], clens: list[int]) -> Packed | None:
    """pack_rows with each prompt that two or more rows share packed once (its rows' completions as child
    segments); None where no two rows share a prompt."""
    rows = input_ids.tolist()
    key = [tuple(r[:n]) for r, n in zip(rows, plens)]
    count: dict = {}
    for k in key:
        count[k] = count.get(k, 0) + 1
    if max(count.values(), default=0) < 2:
        return None
    ids: list[int] = []
    pos: list[int] = []
    pred: list[int] = []
    lens: list[int] = []
    parents: list[int] = []
    prompt_seg: dict = {}  # prompt -> (its segment, the packed position of its last token)
    for row, k, pn, cn in zip(rows, key, plens, clens):
        if count[k] < 2 or cn < 1:  # a prompt of its own (or nothing after it): the whole row, one segment
            start = len(ids)
            ids += row[:pn + cn]
            pos += range(pn + cn)
            pred += range(start + pn - 1, start + pn + cn - 1)
            lens.append(pn + cn)
            parents.append(-1)
            continue
        if k not in prompt_seg:
            ids += row[:pn]
            pos += range(pn)
            lens.append(pn)
            parents.append(-1)
            prompt_seg[k] = (len(lens) - 1, len(ids) - 1)
        seg, last = prompt_seg[k]
        start = len(ids)
        ids += row[pn:pn + cn]
        pos += range(pn, pn + cn)
        pred += [last] + list(range(start, start + cn - 1))  # the first token from the prompt's last state
        lens.append(cn)
        parents.append(seg)
    device = input_ids.device
    pl, cl = torch.tensor(plens, device=device), torch.tensor(clens, device=device)
    j = torch.arange(max(clens), device=device)
    r_idx, cols = (j[None, :] < cl[:, None]).nonzero(as_tuple=True)
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)[None]  # noqa: E731
    return Packed(input_ids=as_t(ids), position_ids=as_t(pos), pred=as_t(pred)[0],
                  targets=input_ids[r_idx, pl[r_idx] + cols], rows=r_idx, cols=cols, lens=lens, parents=parents)


def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention would let packed rows see each other (never a silent wrong answer)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        raise ValueError(f"padding_free needs an attention implementation that confines packed rows "
                         f"({', '.join(PACKED_ATTENTION)}); this model uses {impl!r}: set padding_free false")


def forward_tokens(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, packed: bool) -> tuple[int, int]:
    """(computed, real) tokens of one forward over these rows: packed computes only the real ones; padded, every
    row to the longest. padding_share = (computed - real) / computed."""
    lens = prompt_lens + completion_lens
    real = int(lens.sum())
    return (real if packed or not lens.numel() else int(lens.numel()) * int(lens.max())), real


def padding_share(computed: int, real: int) -> float:
    return (computed - real) / computed if computed else 0.0


def pack_plan(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, pack_tokens: int | None
              ) -> list[torch.Tensor]:
    """Row indices of each packed forward over these rows: consecutive rows of at most `pack_tokens` real tokens
    per pack (one row at least, so a longer row is a pack of its own); None or 0: all rows in one pack."""
    lens = (prompt_lens + completion_lens).cpu()
    if not pack_tokens:
        return [torch.arange(lens.numel())]
    return row_groups(lens, pack_tokens, packed=True)


def row_groups(lens: torch.Tensor, budget: int, packed: bool) -> list[torch.Tensor]:
    """Row indices of forwards of at most `budget` computed tokens each (one row at least): packed, rows in order
    while their lengths add up to the budget; padded, rows sorted by length first, so each forward pads only to
    rows of similar length (where packing is off, the padding left is small)."""
    order = torch.arange(lens.numel()) if packed else torch.argsort(lens.cpu(), stable=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    cost = 0
    for i in order.tolist():
        n = int(lens[i])
        new = cost + n if packed else (len(cur) + 1) * n  # sorted ascending: this row is the longest so far
        if cur and new > budget:
            groups.append(cur)
            cur, new = [], n
        cur.append(i)
        cost = new
    if cur:
        groups.append(cur)
    return [torch.tensor(g, dtype=torch.long) for g in groups]
