"""Doubles for the agent endpoint's tests: an engine that samples scripted turns (token by token, so decode +
encode would not give them back) and records every call it serves, and a spy around a real engine."""
from __future__ import annotations

import threading
import time

import torch

from trainer.engines.base import GenEngine, Sample, budgets, cut_at_eos


class Recorder:
    """What an engine was asked and gave: one (prompts, budgets, samples) per generate call."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], list[int], list[Sample]]] = []
        self._lock = threading.Lock()

    def add(self, prompts, limits, samples) -> None:
        with self._lock:
            self.calls.append(([list(p) for p in prompts], list(limits), samples))

    def served(self) -> list[tuple[list[int], list[int]]]:
        """(context, sampled ids) of every request served, in order."""
        return [(p, s.completion_ids.tolist()) for ps, _, ss in self.calls for p, s in zip(ps, ss)]


class ScriptedEngine(GenEngine):
    """Request k (in the order served) samples turns[k] (the last one again past the script), logprob
    -(position + 1) / 100 per token; `delay` seconds per generate call (to let concurrent requests pile up)."""

    def __init__(self, tok, turns: list[list[int]], delay: float = 0.0, by_prompt=None):
        self.tok, self.turns, self.delay, self.by_prompt = tok, turns, delay, by_prompt
        self.eos_ids = [tok.eos_token_id]
        self.rec = Recorder()
        self.k = 0

    def generate(self, prompt_ids, n, *, max_new_tokens, greedy=False):
        time.sleep(self.delay)
        limits = budgets(max_new_tokens, len(prompt_ids))
        out = []
        for p, limit in zip(prompt_ids, limits):
            turn = self.by_prompt(p) if self.by_prompt else self.turns[min(self.k, len(self.turns) - 1)]
            self.k += 1
            ids, trunc = cut_at_eos(torch.tensor(turn, dtype=torch.long), self.eos_ids, limit)
            out.append(Sample(list(p), ids, -(torch.arange(len(ids), dtype=torch.float32) + 1) / 100, trunc))
        self.rec.add(prompt_ids, limits, out)
        return out


class SpyEngine(GenEngine):
    """A real engine, its calls recorded."""

    def __init__(self, engine):
        self.engine, self.eos_ids, self.rec = engine, engine.eos_ids, Recorder()

    def generate(self, prompt_ids, n, *, max_new_tokens, greedy=False):
        out = self.engine.generate(prompt_ids, n, max_new_tokens=max_new_tokens, greedy=greedy)
        self.rec.add(prompt_ids, budgets(max_new_tokens, len(prompt_ids)), out)
        return out
