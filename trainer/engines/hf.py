"""HF `generate` engine: left-padded batches with a KV cache, sampling exactly our configured distribution.

The checkpoint's generation_config is swapped for a clean one during each call (and restored after), so
transformers merges nothing in: no repetition_penalty, no top_k of the checkpoint, in rollouts and in
greedy evaluation alike. Behaviour logprobs: with `logprob_temperature` set (from_config does where the run
uploads them, compute_gen_logps), each sampled token's logprob under the raw distribution at that temperature,
from the logits generate already computed (its `output_logits`: the model's own final logits, before any
sampler setting), so the worker needs no second forward for them (issue 62); they match the trainer's forward
to float rounding (tests/test_engines.py). Otherwise, and where a call's logits would exceed LOGITS_BYTES,
logprobs=None: the caller computes them with the same forward the trainer uses (common/logprobs.py).

A group's n samples share one prompt: its tokens but the last go through the model once per distinct prompt, and
that KV cache is repeated for the group's rows (`_shared_prefill`), where generate would compute the same prompt n
times (16 % of the demo worker's CPU was that prefill, issue 62). The sampled distribution is unchanged: the same
logits to float rounding (greedy decodes equal, tests/test_engines.py). ZeRO-3 ranks generating together
(synced_gpus) keep generate's own prefill: every rank must make the same module calls.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable

import torch

from common.modeling import eos_ids as model_eos_ids
from common.modeling import load_model, load_tokenizer
from common.placement.memory_plan import KEPT_LOGITS_BYTES
from common.settings.gen_defaults import on_cuda, resolve_generation, unresolved
from trainer.dist.comm import all_reduce_int
from trainer.engines.base import GenEngine, Sample, budgets, cut_at_eos, ignored_generation_settings
from trainer.engines.gumbel import gumbel_sampler, plain_sampler

log = logging.getLogger(__name__)
# generate keeps every step's (rows, vocab) float32 logits until it returns: above this, a call samples without
# them and the caller's forward computes the logprobs (Qwen2.5's vocab: 256 rows x 256 tokens would be 40 GB);
# the memory plan counts the same bound
LOGITS_BYTES = KEPT_LOGITS_BYTES


def rows_that_fit(model, rows: int, seq_len: int, share: float = 0.5) -> int:
    """At most `rows` sequences per generate call, fewer where their KV cache and logits would not fit in `share` of
    the GPU's free memory now (the rest: activations, the allocator's slack; a rank's training keeps its own).
    On CPU (or with no model yet: a rank that only reads scored batches): `rows` as given."""
    p = next(model.parameters()) if model is not None else None
    if p is None or p.device.type != "cuda":
        return rows
    c = model.config
    heads = getattr(c, "num_attention_heads", 1)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_row = 2 * c.num_hidden_layers * kv_heads * head_dim * seq_len * p.element_size() + 3 * 4 * c.vocab_size
    free, _ = torch.cuda.mem_get_info(p.device)
    fit = max(1, int(share * free) // per_row)
    if fit < rows:
        log.info("HF engine: %d sequences per generate call (gen_batch_size %d): the KV cache of more does not fit "
                 "in half the GPU's %.1f GiB free", fit, rows, free / 2**30)
    return min(rows, fit)


class HFEngine(GenEngine):
    def __init__(self, model, tokenizer, eos_ids: list[int], *, temperature: float, top_p: float, top_k: int,
                 gen_batch_size: int, synced_gpus: bool = False, extra: dict | None = None,
                 seq_len: int | None = None, logprob_temperature: float | None = None):
        self.model, self.tok, self.eos_ids = model, tokenizer, list(eos_ids)
        if seq_len is not None:  # batches to the GPU's memory (rows_that_fit); the calls count is agreed per call
            gen_batch_size = rows_that_fit(model, gen_batch_size, seq_len)
        # ZeRO-3 ranks generating together: every rank keeps calling forward until all are done
        # (each forward gathers the partitioned weights from every rank), as transformers' synced_gpus does.
        self.synced_gpus = synced_gpus
        self.temperature, self.top_p, self.top_k, self.gen_batch_size = temperature, top_p, top_k, gen_batch_size
        self.logprob_temperature = logprob_temperature  # None: Samples carry no logprobs
        self.extra = dict(extra or {})  # min_p, repetition_penalty, generation_kwargs (TRL's), rollouts only
        ignored = ignored_generation_settings(getattr(model, "generation_config", None))
        if ignored:
            log.info("HF engine ignores the checkpoint's generation_config %s: sampling is exactly temperature=%s "
                     "top_p=%s top_k=%s", ignored, temperature, top_p, top_k)

    @classmethod
    def from_config(cls, cfg, model_path: str, *, model=None, tokenizer=None) -> HFEngine:
        if unresolved(cfg):  # a cfg built in code: its `auto` values for this device, as a worker's at start
            cfg, _ = resolve_generation(cfg, cuda=on_cuda(cfg.device))
        tok = tokenizer or load_tokenizer(model_path, cfg.load_options())
        model = model if model is not None else load_model(model_path, device=cfg.device, dtype=cfg.worker_dtype,
                                                           options=cfg.load_options())
        chat = cfg.prompt_format != "r1zero"  # templated prompts also stop at the template's turn end
        return cls(model, tok, model_eos_ids(tok, model, chat=chat), temperature=cfg.temperature, top_p=cfg.top_p,
                   top_k=cfg.top_k, gen_batch_size=cfg.gen_batch_size, extra=cfg.sampling_extras(),
                   seq_len=cfg.max_prompt_length + max(cfg.max_new_tokens, cfg.eval_max_new_tokens or 0),
                   logprob_temperature=cfg.logprob_temperature() if cfg.compute_gen_logps else None)

    def _clean_config(self, greedy: bool, max_new_tokens: int):
        """(generation config, logits processors): the plain sampler samples by Gumbel-max in generate's greedy
        loop (trainer/engines/gumbel.py: the same distribution, a third of multinomial's CPU cost)."""
        from transformers import GenerationConfig

        # Explicit values for everything that shapes the distribution: transformers fills only unset (None)
        # fields from the model's config, and the model's config is swapped out anyway.
        gumbel = not greedy and plain_sampler(self.extra)
        kw = dict(do_sample=False) if greedy or gumbel else dict(do_sample=True, temperature=self.temperature,
                                                                 top_p=self.top_p, top_k=self.top_k)
        neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0)
        gc = GenerationConfig(**kw, eos_token_id=self.eos_ids, pad_token_id=self.tok.pad_token_id,
                              bos_token_id=getattr(self.model.generation_config, "bos_token_id", None),
                              **{**neutral, **({} if greedy or gumbel else self.extra)}, num_beams=1,
                              use_cache=True, max_new_tokens=max_new_tokens)
        return gc, gumbel_sampler(self.temperature, self.top_k, self.top_p) if gumbel else None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, *, max_new_tokens: int | list[int],
                 greedy: bool = False) -> list[Sample]:
        model, pad = self.model, self.tok.pad_token_id
        device = next(model.parameters()).device
        limits = [b for b in budgets(max_new_tokens, len(prompt_ids)) for _ in range(n)]
        jobs = [p for p in prompt_ids for _ in range(n)]
        out: list[Sample] = []
        was_training, saved = model.training, model.generation_config
        gc, procs = self._clean_config(greedy, max(limits, default=1))  # each row is cut to its own budget below
        # one choice for the whole call: every sample of a group has logprobs, or none has
        keep = self._keeps_logits(greedy, min(len(jobs), self.gen_batch_size), max(limits, default=1))
        if keep:  # generate returns its per-step raw logits with the sequences
            gc.return_dict_in_generate, gc.output_logits = True, True
        model.eval()
        model.generation_config = copy.deepcopy(gc)  # nothing of the checkpoint's left to merge in
        try:
            calls = math.ceil(len(jobs) / self.gen_batch_size)
            if self.synced_gpus:  # as many generate calls as the rank with the most prompts; a dummy prompt past ours
                calls = all_reduce_int(calls, "max")
            for c in range(calls):
                chunk = jobs[c * self.gen_batch_size:(c + 1) * self.gen_batch_size]
                lim = limits[c * self.gen_batch_size:(c + 1) * self.gen_batch_size]
                dummy = not chunk
                chunk = chunk or [[pad]]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(chunk):
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                ids, mask = ids.to(device), mask.to(device)
                cache = None if self.synced_gpus else _shared_prefill(model, ids, mask)
                got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, generation_config=gc,
                                     logits_processor=procs, synced_gpus=self.synced_gpus or None)
                if dummy:
                    continue
                seqs = got.sequences if keep else got
                comps = seqs[:, width:].cpu()
                lps = self._token_logprobs(got.logits, seqs[:, width:]) if keep else None
                for i, p in enumerate(chunk):
                    c, trunc = cut_at_eos(comps[i], self.eos_ids, lim[i])
                    out.append(Sample(list(p), c.clone(), None if lps is None else lps[i, :len(c)].clone(), trunc))
        finally:
            model.generation_config = saved
            model.train(was_training)
        return out

    def _keeps_logits(self, greedy: bool, rows: int, steps: int) -> bool:
        """Whether this call returns logprobs from generate's own logits (see LOGITS_BYTES)."""
        if greedy or self.logprob_temperature is None:
            return False
        return rows * steps * self.model.config.get_text_config().vocab_size * 4 <= LOGITS_BYTES

    def _token_logprobs(self, logits: tuple[torch.Tensor, ...], comps: torch.Tensor) -> torch.Tensor:
        """(rows, steps) float32 logprob of each generated token under the raw logits at logprob_temperature:
        common/logprobs.py's computation (float32, divided by T, log-softmax) on the logits generate computed."""
        t = self.logprob_temperature
        cols = [torch.log_softmax(x.float() / t, dim=-1).gather(1, comps[:, s:s + 1].to(x.device))
                for s, x in enumerate(logits)]
        return torch.cat(cols, dim=1).cpu() if cols else torch.zeros(comps.shape[0], 0)

    def weight_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the live parameters (a subset is fine; names must exist)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied aliases (lm_head) too
        with torch.no_grad():
            for name, t in named:
                if name not in params:
                    raise ValueError(f"weights: {name!r} is not a parameter of this model")
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"weights: {name} has shape {tuple(t.shape)}, model has {tuple(p.shape)}")
                p.copy_(t.to(dtype=p.dtype, device=p.device))


def _shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor):
    """The KV cache of each row's prompt but its last token, computed once per distinct prompt of a run of equal
    rows and repeated for them; None where no row shares its prompt with the next (nothing to save). generate
    then feeds only the last prompt token (its cache_position starts past the cache), with the same positions
    (from the left-padded attention mask) as its own prefill uses."""
    if ids.shape[1] < 2:
        return None
    new = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    new[1:] = (ids[1:] != ids[:-1]).any(1)  # rows are grouped: a group's samples are consecutive
    firsts = new.nonzero().squeeze(1)
    if len(firsts) == ids.shape[0]:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base's body
    body = getattr(base, base.base_model_prefix)  # the decoder without the LM head: no logits for the prompt
    m = mask[firsts, :-1]
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    cache = body(input_ids=ids[firsts, :-1], attention_mask=m, position_ids=pos, use_cache=True).past_key_values
    if not hasattr(cache, "batch_select_indices"):  # a cache type that cannot be re-indexed: generate's prefill
        return None
    cache.batch_select_indices(torch.cumsum(new.long(), 0) - 1)  # each row: its prompt's cache
    return cache
