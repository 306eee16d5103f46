"""Rollouts: sample a group of completions per prompt, reward them, build upload batches.

The exact sampled token ids travel to the server (never decoded and re-tokenised); the
completion length counts tokens up to and including the first end-of-sequence token, so
masks come from lengths even when pad == eos.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.logprobs import sequence_logprobs
from common.prompts import SYSTEM_PROMPT
from common.protocol import RolloutBatch
from trainer.data import Example, build_prompt
from trainer.grpo import group_advantages, has_spread
from trainer.rewards import score_completion


@dataclass
class RolloutStats:
    groups: int = 0
    skipped_no_spread: int = 0
    skipped_long_prompt: int = 0
    completions: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    rewards: list = field(default_factory=list)
    components: dict = field(default_factory=dict)


def encode_prompts(tokenizer, examples: list[Example], system_prompt: str | None, max_prompt_length: int
                   ) -> tuple[list[tuple[Example, list[int]]], int]:
    """Chat-template and tokenise; prompts over max_prompt_length are dropped and counted."""
    kept, skipped = [], 0
    sp = SYSTEM_PROMPT if system_prompt == "default" else system_prompt
    for ex in examples:
        ids = tokenizer(build_prompt(tokenizer, ex.prompt, sp), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            skipped += 1
            continue
        kept.append((ex, ids))
    return kept, skipped


def completion_lengths(completions: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) generated ids -> lengths including the first eos, and a `truncated` flag (no eos)."""
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))
    has_eos = is_eos.any(1)
    first = torch.where(has_eos, is_eos.float().argmax(1) + 1, torch.full_like(has_eos, completions.shape[1],
                                                                               dtype=torch.long))
    return first.long(), ~has_eos


@torch.no_grad()
def sample(model, tokenizer, prompt_ids: list[list[int]], n: int, *, max_new_tokens: int, temperature: float,
           top_p: float, eos_ids: list[int], gen_batch_size: int, do_sample: bool = True
           ) -> list[tuple[list[int], torch.Tensor]]:
    """n completions for each prompt (left-padded HF generate, KV cache). Returns (prompt, completion ids)."""
    device = next(model.parameters()).device
    jobs = [p for p in prompt_ids for _ in range(n)]
    out: list[tuple[list[int], torch.Tensor]] = []
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(jobs), gen_batch_size):
            chunk = jobs[s:s + gen_batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            gen_kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample else \
                dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                                  pad_token_id=tokenizer.pad_token_id, use_cache=True, **gen_kw)
            comps = seqs[:, width:].cpu()
            lens, _ = completion_lengths(comps, eos_ids)
            for i, p in enumerate(chunk):
                out.append((p, comps[i, :int(lens[i])]))
    finally:
        model.train(was_training)
    return out


def pack_rows(rows: list[tuple[list[int], torch.Tensor]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(prompt ids, completion ids)] -> right-padded input_ids (B, L), prompt_lens, completion_lens."""
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        ids[i, len(p):len(p) + len(c)] = c
    return ids, torch.tensor([len(p) for p, _ in rows]), torch.tensor([len(c) for _, c in rows])


def generate_batches(model, tokenizer, examples: list[Example], cfg, reward_fns: list[Callable], eos_ids: list[int],
                     policy_version: int = 0, producer_id: str = "") -> tuple[list[RolloutBatch], RolloutStats]:
    """One generation round: a RolloutBatch per prompt group with reward spread."""
    t0 = time.time()
    stats = RolloutStats()
    kept, stats.skipped_long_prompt = encode_prompts(tokenizer, examples, cfg.system_prompt, cfg.max_prompt_length)
    if not kept:
        return [], stats
    samples = sample(model, tokenizer, [ids for _, ids in kept], cfg.num_pre_Q, max_new_tokens=cfg.max_new_tokens,
                     temperature=cfg.temperature, top_p=cfg.top_p, eos_ids=eos_ids,
                     gen_batch_size=cfg.gen_batch_size)
    batches = []
    for g, (ex, _) in enumerate(kept):
        rows = samples[g * cfg.num_pre_Q:(g + 1) * cfg.num_pre_Q]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for _, c in rows]
        scored = [score_completion(t, ex.ground_truth, reward_fns) for t in texts]
        rewards = torch.tensor([s for s, _ in scored], dtype=torch.float32)
        components = {k: [c[k] for _, c in scored] for k in scored[0][1]}
        truncated = [bool(len(c) == cfg.max_new_tokens and int(c[-1]) not in eos_ids) for _, c in rows]
        stats.groups += 1
        stats.completions += len(rows)
        stats.completion_tokens += sum(len(c) for _, c in rows)
        stats.rewards.extend(rewards.tolist())
        for k, v in components.items():
            stats.components.setdefault(k, []).extend(v)
        if not has_spread(rewards):
            stats.skipped_no_spread += 1
            continue
        ids, plens, clens = pack_rows(rows, tokenizer.pad_token_id)
        batch = RolloutBatch(input_ids=ids, prompt_lens=plens, completion_lens=clens,
                             advantages=group_advantages(rewards, cfg.advantage_mode), rewards=rewards,
                             policy_version=policy_version, producer_id=producer_id, batch_id=uuid.uuid4().hex,
                             extra={"components": components, "truncated": truncated})
        if ex.index is not None:  # which example this group answers (exact-resume checks, metrics)
            batch.extra["example_index"] = [ex.index]  # a list: collate() concatenates lists
        if cfg.compute_gen_logps:
            with torch.no_grad():
                batch.gen_logps, _ = sequence_logprobs(model, ids, plens, clens, chunk_tokens=cfg.logp_chunk_tokens)
                batch.gen_logps = batch.gen_logps.float().cpu()
        batches.append(batch)
    stats.seconds = time.time() - t0
    return batches, stats
