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
from trainer.engines import GenEngine, Sample
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


def pack_rows(rows: list[tuple[list[int], torch.Tensor]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(prompt ids, completion ids)] -> right-padded input_ids (B, L), prompt_lens, completion_lens."""
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        ids[i, len(p):len(p) + len(c)] = c
    return ids, torch.tensor([len(p) for p, _ in rows]), torch.tensor([len(c) for _, c in rows])


def engine_logps(samples: list[Sample]) -> torch.Tensor:
    """The engine's per-token logprobs of a group as (B, T) float32, zeros past each completion."""
    T = max(len(s.completion_ids) for s in samples)
    out = torch.zeros(len(samples), T, dtype=torch.float32)
    for i, s in enumerate(samples):
        out[i, :len(s.logprobs)] = s.logprobs
    return out


def generate_batches(engine: GenEngine, tokenizer, examples: list[Example], cfg, reward_fns: list[Callable],
                     policy_version: int = 0, producer_id: str = "") -> tuple[list[RolloutBatch], RolloutStats]:
    """One generation round: a RolloutBatch per prompt group with reward spread.

    gen_logps are the engine's own logprobs when it returns them (vLLM, no second forward), otherwise
    one forward of the HF engine's model, the same computation the trainer does."""
    t0 = time.time()
    stats = RolloutStats()
    kept, stats.skipped_long_prompt = encode_prompts(tokenizer, examples, cfg.system_prompt, cfg.max_prompt_length)
    if not kept:
        return [], stats
    samples = engine.generate([ids for _, ids in kept], cfg.num_pre_Q, max_new_tokens=cfg.max_new_tokens)
    batches = []
    for g, (ex, _) in enumerate(kept):
        group = samples[g * cfg.num_pre_Q:(g + 1) * cfg.num_pre_Q]
        rows = [(s.prompt_ids, s.completion_ids) for s in group]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for _, c in rows]
        scored = [score_completion(t, ex.ground_truth, reward_fns) for t in texts]
        rewards = torch.tensor([s for s, _ in scored], dtype=torch.float32)
        components = {k: [c[k] for _, c in scored] for k in scored[0][1]}
        truncated = [s.truncated for s in group]
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
        if cfg.compute_gen_logps and group[0].logprobs is not None:
            batch.gen_logps = engine_logps(group)
            batch.extra["gen_logps_source"] = "engine"  # the trainer's mismatch metric compares against these
        elif cfg.compute_gen_logps:
            with torch.no_grad():
                batch.gen_logps, _ = sequence_logprobs(engine.model, ids, plens, clens,
                                                       chunk_tokens=cfg.logp_chunk_tokens)
                batch.gen_logps = batch.gen_logps.float().cpu()
        batches.append(batch)
    stats.seconds = time.time() - t0
    return batches, stats
