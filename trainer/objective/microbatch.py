"""Micro-batches: a rank's training batch split by rows, gradients accumulated, one optimizer update.

A training batch (train_batch_groups x num_pre_Q rows of up to max_new_tokens) in one forward and backward is
where a GPU runs out of memory; `micro_batch_size` rows at a time bound the activations instead. Each
micro-batch's loss is weighted so that the weighted losses sum to the whole batch's loss, so the accumulated
gradient equals the whole-batch gradient for every aggregation but TRL's bnpo:

    seq_mean, dr_grpo  per-completion terms / the batch's rows      -> weight rows_mb / rows
    dapo               per-token terms / the batch's masked tokens  -> weight tokens_mb / tokens
    token_mean (TRL's bnpo) is TRL's per micro-batch token mean: each micro-batch weighs 1 / micro-batches, so
    here micro_batch_size (TRL's per_device_train_batch_size) changes the gradient, as in TRL; so does
    top_entropy_quantile, cut per micro-batch (over every rank). Those two keep the rows in order (per_micro).
    (the mask is the one update.py new_round built: completion tokens AND the loss mask, so a tool turn's
    tokens count in no micro-batch's weight; it is split by the same rows as everything else)
    (GSPO's sequence ratio and truncated IS are per row: unchanged by a split by rows.)

DeepSpeed accumulates: its gradient_accumulation_steps is grad_accum x micro-batches per step
(trainer/deepspeed_policy.py), so engine.step() updates only after the step's last micro-batch, and engine.backward
divides each loss by that count; we multiply it back by the micro-batch count (`backward_scale`), leaving
grad_accum's own averaging over steps as it was.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import GRPOConfig
from common.wire.protocol import ScoredBatch


def rows_per_step(cfg: GRPOConfig) -> int:
    """Rows of one rank's training batch: train_batch_groups groups of num_pre_Q completions."""
    return cfg.train_batch_groups * cfg.num_pre_Q


def micro_rows(cfg: GRPOConfig) -> int:
    """Rows per micro-batch (micro_batch_size; 0 = the whole batch at once)."""
    return min(cfg.micro_batch_size or rows_per_step(cfg), rows_per_step(cfg))


def micro_batches_per_step(cfg: GRPOConfig) -> int:
    return math.ceil(rows_per_step(cfg) / micro_rows(cfg))


def per_micro(cfg: GRPOConfig) -> bool:
    """Whether the loss depends on which rows share a micro-batch (bnpo's normaliser, the entropy cut): then the
    micro-batches keep the batch's row order, never regrouped by length."""
    return cfg.aggregation == "token_mean" or cfg.top_entropy_quantile < 1.0


@dataclass
class Micro:
    """One micro-batch: its rows of the batch, trimmed to its own widths, and its loss weight."""
    input_ids: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    mask: torch.Tensor          # (b, T_mb) bool, completion tokens in the loss
    adv: torch.Tensor           # (b,)
    gen: torch.Tensor | None    # (b, T_mb) generation-time logps
    ref: torch.Tensor | None    # (b, T_mb) reference logps
    weight: float               # this micro-batch's share of the whole batch's loss
    rows: slice | torch.Tensor  # the batch's rows: a slice, or their indices when grouped by length


def split(b: ScoredBatch, mask: torch.Tensor, adv: torch.Tensor, gen: torch.Tensor | None,
          ref: torch.Tensor | None, size: int, aggregation: str, by_length: bool = False) -> list[Micro]:
    """The batch's rows in micro-batches of `size` (the last may be smaller), each with its loss weight.

    by_length: rows sorted by their real length first, so each micro-batch pads only to rows of similar length
    (the padded path's answer to ragged groups, issue 33). Every loss term is per row or per token and each
    micro-batch's weight counts its own rows / tokens, so the order changes no gradient (bnpo and the entropy cut
    depend on it: per_micro keeps them in row order); the count of micro-batches (DeepSpeed's accumulation
    boundary) is the same either way."""
    B = b.input_ids.shape[0]
    tokens = mask.sum().clamp(min=1).item()
    n_micro = math.ceil(B / size)
    order = torch.argsort(b.prompt_lens + b.completion_lens, stable=True) if by_length else None
    out = []
    for s in range(0, B, size):
        r = slice(s, min(s + size, B)) if order is None else order[s:s + size]
        plen, clen = b.prompt_lens[r], b.completion_lens[r]
        T = int(clen.max())  # what sequence_logprobs returns for these rows
        L = int((plen + clen).max())
        m = mask[r, :T]
        n = int(clen.numel())
        w = m.sum().item() / tokens if aggregation == "dapo" else 1 / n_micro if aggregation == "token_mean" else n / B
        out.append(Micro(b.input_ids[r, :L], plen, clen, m, adv[r], None if gen is None else gen[r, :T],
                         None if ref is None else ref[r, :T], w, r))
    return out


def backward_scale(n_micro: int) -> float:
    """Undo DeepSpeed's division by its gradient_accumulation_steps (= grad_accum x n_micro) for the
    micro-batch share, so the weighted micro losses add up to the whole batch's loss / grad_accum."""
    return float(n_micro)


def join(parts: list[torch.Tensor], micros: list[Micro], B: int, T: int) -> torch.Tensor:
    """Per-micro-batch (b, T_mb) tensors back into one zero-padded (B, T) tensor (for diagnostics)."""
    out = parts[0].new_zeros(B, T)
    for p, mb in zip(parts, micros):
        out[mb.rows, :p.shape[1]] = p
    return out
