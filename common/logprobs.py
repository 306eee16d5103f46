"""Per-token log-probabilities of completion tokens, without a B x L x V float32 log-softmax.

Shared by the ref server (frozen model, inference mode) and the trainer (with autograd).
We run the decoder body once, pick the hidden states that predict completion tokens, and
push them through the LM head a chunk of positions at a time: logp = logit[target] -
logsumexp(logits). Only one chunk of float32 logits exists at a time; under autograd each
chunk is checkpointed, so backward recomputes it instead of keeping every chunk alive.

The logits are those the model's own forward returns (its final-logit processing, common/final_logits.py,
e.g. Gemma-2 soft-capping, in the head's dtype), upcast to float32 and then divided by `temperature`:
logprobs of the distribution the rollouts were sampled from (TRL, verl) at the sampling temperature, of the
raw distribution at 1 (simple_GRPO).
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from common.final_logits import LogitFn, final_logit_fn
from common.packed_attention import install, packed_call_kwargs, shares_prompts
from common.packing import Packed, check_packed_attention, pack_plan, pack_rows


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(..., V) logits, (...) int targets -> (...) float32 log p(target). Upcasts once, per call."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_index(prompt_lens: torch.Tensor, completion_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of completion token j in row i, shape (B, T), and the (B, T) validity mask.

    Padding entries point at the row's first completion token so every index is in range.
    """
    T = int(completion_lens.max())
    j = torch.arange(T, device=prompt_lens.device)
    valid = j[None, :] < completion_lens[:, None]
    pos = prompt_lens[:, None] + j[None, :]
    return torch.where(valid, pos, prompt_lens[:, None].expand_as(pos)), valid


def attention_mask_from_lengths(total_lens: torch.Tensor, L: int) -> torch.Tensor:
    return (torch.arange(L, device=total_lens.device)[None, :] < total_lens[:, None]).long()


def _frozen_zero3(lm_head: torch.nn.Module) -> bool:
    ps = list(lm_head.parameters())
    return bool(ps) and not any(p.requires_grad for p in ps) and all(hasattr(p, "ds_id") for p in ps)


@torch.no_grad()
def _gathered_copy(lm_head: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) copied while ZeRO-3's forward hooks hold the head gathered (one 1-position forward)."""
    got: dict = {}

    def grab(mod, _inp):  # runs after ZeRO-3's own pre-forward hook (registered earlier) gathered the weight
        got["w"] = mod.weight.detach().clone()
        got["b"] = mod.bias.detach().clone() if getattr(mod, "bias", None) is not None else None

    handle = lm_head.register_forward_pre_hook(grab)
    try:
        lm_head(hidden[:1, :1].detach())
    finally:
        handle.remove()
    return got["w"], got["b"]


def chunk_count(rows: int, width: int, chunk_tokens: int) -> int:
    """How many LM-head calls logprobs_from_hidden makes for (rows, width) completion positions."""
    return math.ceil(width / max(1, chunk_tokens // max(rows, 1)))


def head_calls(completion_lens: torch.Tensor, chunk_tokens: int, padding_free: bool = False) -> int:
    """How many LM-head calls sequence_logprobs makes for rows of these completion lengths: padded, the (B, T)
    completion positions; padding-free, the sum of the lengths as one row (common/packing.py)."""
    if padding_free:
        return chunk_count(1, int(completion_lens.sum()), chunk_tokens)
    return chunk_count(int(completion_lens.numel()), int(completion_lens.max()), chunk_tokens)


def forward_calls(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, chunk_tokens: int,
                  padding_free: bool = False, pack_tokens: int | None = None) -> tuple[int, int]:
    """(body forwards, LM-head calls per forward) sequence_logprobs makes for these rows: padded, one forward;
    padding-free, one per pack of at most pack_tokens tokens (common/packing.py pack_plan), each calling the head
    for its own completion positions (the most of any pack: what min_chunks must cover)."""
    if not padding_free:
        return 1, head_calls(completion_lens, chunk_tokens)
    packs = pack_plan(prompt_lens, completion_lens, pack_tokens)
    return len(packs), max(head_calls(completion_lens[g.to(completion_lens.device)], chunk_tokens, True)
                           for g in packs)


def logprobs_from_hidden(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor,
                         chunk_tokens: int = 256, with_entropy: bool = False, min_chunks: int = 0,
                         logit_fn: LogitFn | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden (B, T, H) predicting targets (B, T) -> logps (B, T) float32 [, entropy (B, T)].

    min_chunks: call the head at least this often, with empty chunks past T. Under ZeRO-3 every head call is a
    collective, so ranks whose longest completions differ pass the count they agreed on (the maximum).
    logit_fn: applied to each chunk of head outputs (final-logit processing, temperature)."""
    post = logit_fn or (lambda x: x)
    B, T, _ = hidden.shape
    step = max(1, chunk_tokens // max(B, 1))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))

    def from_logits(logits: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logp and (with_entropy) the entropy from the SAME logits: the head runs once per chunk in the forward
        # (and once more in the checkpoint's recompute for backward), never again for the entropy
        logits = post(logits).float()
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
        if not with_entropy:
            return logp, lse.new_zeros(0)
        with torch.no_grad():  # a diagnostic and the entropy mask: no gradient through it
            d = logits.detach()
            ent = lse.detach() - (torch.softmax(d, dim=-1) * d).sum(-1)
        return logp, ent

    def chunk_fn(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return from_logits(lm_head(h), t)

    if grad and _frozen_zero3(lm_head):
        # A frozen head under ZeRO-3 (LoRA) is gathered only while its forward runs, so the checkpoint's
        # recompute would see the released (empty) weight: use a full copy taken during one forward instead.
        weight, bias = _gathered_copy(lm_head, hidden)

        def chunk_fn(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: F811
            return from_logits(torch.nn.functional.linear(h, weight, bias), t)

    out, ents = [], []
    starts = list(range(0, T, step))
    starts += [T] * (min_chunks - len(starts))  # empty chunks: same calls as the other ranks, no positions
    for s in starts:
        h, t = hidden[:, s:s + step], targets[:, s:s + step]
        lp, en = checkpoint(chunk_fn, h, t, use_reentrant=False) if grad else chunk_fn(h, t)
        out.append(lp)
        ents.append(en)
    return torch.cat(out, dim=1), (torch.cat(ents, dim=1) if with_entropy else None)


def logit_fn_for(model: torch.nn.Module, temperature: float = 1.0) -> LogitFn | None:
    """The model's final-logit processing followed by the division by `temperature` (None: neither)."""
    final = final_logit_fn(model)
    if temperature <= 0:
        raise ValueError(f"logprob temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return final
    # float32 before the division, as vLLM's sampler does (HF's generate too): a bf16 quotient keeps 8 bits of
    # mantissa, so logits near 30 would move by up to 0.06 and the logprobs with them. The model's own
    # final-logit step stays in the head's dtype, as in its forward (and vLLM's logits processor).
    if final is None:
        return lambda x: x.float() / temperature
    return lambda x: final(x).float() / temperature


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, prompt_lens: torch.Tensor,
                      completion_lens: torch.Tensor, chunk_tokens: int = 256, with_entropy: bool = False,
                      min_chunks: int = 0, temperature: float = 1.0, padding_free: bool = False,
                      pack_tokens: int | None = None, min_packs: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each row's completion tokens under `model` (a HF *ForCausalLM) at `temperature`.

    input_ids (B, L) right-padded prompt+completion rows (see common/wire/protocol.py).
    Returns (B, T) float32 with T = max(completion_lens), zeros past each row's length.
    padding_free: the rows go through the model as packed sequences (common/packing.py) of at most pack_tokens
    tokens each (None: one), the LM head sees only the completion positions; the same numbers within float32
    rounding, no padded token computed. min_packs: forward at least this many packs (ZeRO-3 ranks pass the count
    they agreed on, see forward_calls); min_chunks then counts head calls per pack.
    """
    if hasattr(model, "get_base_model"):  # a peft (LoRA) model: its adapters live inside the base model's layers
        model = model.get_base_model()
    logit_fn = logit_fn_for(model, temperature)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    prompt_lens, completion_lens = prompt_lens.to(device), completion_lens.to(device)
    body = getattr(model, model.base_model_prefix)  # decoder without the LM head
    head = model.get_output_embeddings()
    if padding_free:
        return _packs_logprobs(model, body, head, input_ids, prompt_lens, completion_lens, chunk_tokens,
                               with_entropy, min_chunks, logit_fn, pack_tokens, min_packs)
    B, L = input_ids.shape
    mask = attention_mask_from_lengths(prompt_lens + completion_lens, L)
    install(model)  # sdpa models: the same masks and calls, and on CPU the faster kernel for training (MATH_MAX_LEN)
    hidden = body(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    pos, valid = completion_index(prompt_lens, completion_lens)
    h = hidden.gather(1, (pos - 1)[..., None].expand(-1, -1, hidden.shape[-1]))  # state before each token
    targets = input_ids.gather(1, pos)
    logps, ent = logprobs_from_hidden(h, head, targets, chunk_tokens, with_entropy, min_chunks, logit_fn)
    logps = logps.masked_fill(~valid, 0.0)
    if ent is not None:
        ent = ent.masked_fill(~valid, 0.0)
    return logps, ent


def _packs_logprobs(model, body, head, input_ids, prompt_lens, completion_lens, chunk_tokens, with_entropy,
                    min_chunks, logit_fn, pack_tokens, min_packs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sequence_logprobs padding-free: one packed forward per pack of pack_plan, then dummy ones up to min_packs."""
    check_packed_attention(model)
    groups: list = pack_plan(prompt_lens, completion_lens, pack_tokens)
    groups += [None] * (min_packs - len(groups))  # dummy packs: the same module calls as the other ranks
    B, T = input_ids.shape[0], int(completion_lens.max())
    logps = ent = None
    for g in groups:
        lp, en = _packed_logprobs(model, body, head, input_ids, prompt_lens, completion_lens, g, (B, T), chunk_tokens,
                                  with_entropy, min_chunks if g is not None else max(min_chunks, 1), logit_fn)
        # each pack fills only its own rows (zeros elsewhere): the sum is exact, and keeps every pack (a dummy
        # one too) in the autograd graph, so ZeRO-3's backward gathers for it on every rank alike
        logps = lp if logps is None else logps + lp
        ent = en if ent is None else ent + en  # None throughout without with_entropy
    return logps, ent


def _dummy_pack(input_ids: torch.Tensor) -> Packed:
    """A 1-token pack that predicts nothing: a rank's forward past its own packs (min_packs)."""
    none = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    return Packed(input_ids=input_ids[:1, :1], position_ids=torch.zeros_like(input_ids[:1, :1]), pred=none,
                  targets=none, rows=none, cols=none, lens=[1])


def _packed_logprobs(model, body, head, input_ids, prompt_lens, completion_lens, rows, shape, chunk_tokens,
                     with_entropy, min_chunks, logit_fn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed forward over `rows` (None: a dummy pack), attention confined to each row without a pack-wide
    mask (common/packed_attention.py; eager models: transformers' mask from the restarting position_ids);
    outputs scattered into zeros of the (B, T) `shape` at those rows."""
    if rows is None:
        p, at_rows = _dummy_pack(input_ids), torch.zeros(0, dtype=torch.long, device=input_ids.device)
    else:
        rows = rows.to(input_ids.device)
        # a group's rows share their prompt's tokens where the kernel can (common/packing.py)
        p = pack_rows(input_ids[rows], prompt_lens[rows], completion_lens[rows], share_prompts=shares_prompts(model))
        at_rows = rows[p.rows]  # the pack's row -> the micro-batch's row
    extra = packed_call_kwargs(model, p.lens, p.input_ids.device, p.parents)  # per-row attention, no N x N mask
    hidden = body(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, **extra).last_hidden_state
    h = hidden[:, p.pred]  # (1, K, H): the state before each completion token, no padded position
    logps, ent = logprobs_from_hidden(h, head, p.targets[None], chunk_tokens, with_entropy, min_chunks, logit_fn)
    scatter = lambda x: x.new_zeros(shape).index_put((at_rows, p.cols), x[0])  # noqa: E731  (differentiable)
    return scatter(logps), (scatter(ent) if ent is not None else None)
