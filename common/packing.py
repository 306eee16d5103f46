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
    lens: list[int]             # each row's length in the pack (common/packed_attention.py attends within them)


def pack_rows(input_ids: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor) -> Packed:
    """Right-padded (B, L) rows of prompt_lens + completion_lens real tokens -> one packed sequence."""
    device = input_ids.device
    B, L = input_ids.shape
    lens = prompt_lens + completion_lens
    if bool((lens > L).any()) or bool((prompt_lens < 1).any()):
        raise ValueError(f"rows of {lens.tolist()} tokens (prompts {prompt_lens.tolist()}) do not fit width {L} "
                         f"or have no prompt token to predict the first completion token from")
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
