"""The face every generation engine shows the rest of the trainer (GenEngine, Sample), and what both engines
share: cutting at eos, and the checkpoint sampling settings they switch off."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# generation_config fields that change the sampling distribution, with the value that switches each off.
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
           "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
           "min_length": 0, "min_new_tokens": None, "sequence_bias": None, "suppress_tokens": None,
           "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
           "exponential_decay_length_penalty": None, "renormalize_logits": False, "guidance_scale": None,
           "watermarking_config": None, "diversity_penalty": 0.0, "length_penalty": 1.0, "num_beams": 1,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
OURS = ("temperature", "top_p", "top_k")  # set from GRPOConfig, so not "ignored"


class EngineDied(RuntimeError):
    """An engine failed mid-run (not a bad request): the worker exits non-zero with this message."""


@dataclass
class Sample:
    """One completion: exact sampled ids, cut after the first eos (eos included)."""
    prompt_ids: list[int]
    completion_ids: torch.Tensor          # (T,) long
    logprobs: torch.Tensor | None         # (T,) float32 per completion token (raw distribution), or None
    truncated: bool                       # hit max_new_tokens without an eos
    # (T,) bool, 1 = sampled by the model, 0 = a tool turn's token (multi-turn rollouts); None = all sampled
    loss_mask: torch.Tensor | None = None


def cut_at_eos(ids: torch.Tensor, eos_ids: list[int], max_new_tokens: int) -> tuple[torch.Tensor, bool]:
    """1-D generated ids -> (ids up to and including the first eos, truncated flag). pad == eos safe:
    everything after the first eos is dropped, whatever it is."""
    ids = ids[:max_new_tokens]
    hit = torch.isin(ids, torch.tensor(eos_ids, dtype=ids.dtype)).nonzero()
    if len(hit):
        return ids[:int(hit[0]) + 1], False
    return ids, True


def budgets(max_new_tokens: int | list[int], prompts: int) -> list[int]:
    """One token budget per prompt, from one for all or a list (its length checked)."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * prompts
    if len(max_new_tokens) != prompts:
        raise ValueError(f"{len(max_new_tokens)} token budgets for {prompts} prompts")
    return list(max_new_tokens)


def ignored_generation_settings(generation_config) -> dict:
    """The checkpoint's sampling settings that we switch off (anything not neutral, except ours)."""
    if generation_config is None:
        return {}
    out = {}
    for k, neutral in NEUTRAL.items():
        if k in OURS:
            continue
        v = getattr(generation_config, k, neutral)
        if v is not None and v != neutral and not (k == "min_length" and v == 0):
            out[k] = v
    return out


class GenEngine:
    """The face every engine shows the rest of the trainer."""
    eos_ids: list[int]

    def generate(self, prompt_ids: list[list[int]], n: int, *, max_new_tokens: int | list[int],
                 greedy: bool = False) -> list[Sample]:
        """n samples per prompt, prompt-major. max_new_tokens: one budget for all, or one per prompt (tool rounds:
        each rollout's own remaining tokens)."""
        raise NotImplementedError

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in: a LoRA worker keeps its copy of W0 in it
        (trainer/lora/sync.py), not wider."""
        raise NotImplementedError

    def fused_modules(self) -> dict[str, list[str]]:
        """Engine layers that hold several checkpoint modules (vLLM: qkv_proj = q, k, v); a weight load must
        bring every member of such a layer (trainer/lora/sync.py). None for an engine that loads by name."""
        return {}

    def close(self) -> None:
        """Free the engine's resources (vLLM: its KV cache and threads)."""
