"""Benchmark (issue 42): what the generation defaults buy on CPU vLLM, through the project's VLLMEngine.

    OMP_NUM_THREADS=2 .venv/bin/python bench/generation_batching.py            # Qwen2.5-0.5B shape, bf16
    .venv/bin/python bench/generation_batching.py --smoke                      # the tiny model, seconds

batched_speedup: tokens/s with a step's prompts in one engine call (Q_batch_size as the resolver picks it for a step
of --prompts groups, num_pre_Q 8) / tokens/s with one prompt per call (Q_batch_size 1, as before), same prompts
count, --new-tokens each. prefix_cache_speedup: tokens/s of 8 samples of --long-prompt-token prompts with
vllm_enable_prefix_caching true / false. Each engine is built from a GRPOConfig resolved by
common/settings/gen_defaults.py for CPU (only the compared knob differs); every timed call gets fresh random prompts,
so no call is served from an earlier call's cache. The model: random weights in the Qwen2.5-0.5B shape, built
locally (bench/generation.py). Each figure is the median of --repeats calls, the two settings taking turns.
Last output line: one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/generation.py's model builder
from generation import build_qwen05b  # noqa: E402

from common.config import GRPOConfig  # noqa: E402
from common.modeling import resolve_model_path  # noqa: E402
from common.settings.gen_defaults import resolve_generation  # noqa: E402


def engine_for(path: str, args, **overrides):
    """A VLLMEngine from a GRPOConfig with the CPU defaults the resolver picks (and `overrides`)."""
    from trainer.engines import make_engine

    cfg = GRPOConfig(model=path, gen_backend="vllm", temperature=1.0, top_p=1.0, vllm_dtype=args.dtype,
                     max_prompt_length=args.long_prompt_tokens + 8, max_new_tokens=args.new_tokens,
                     train_batch_groups=args.prompts, num_pre_Q=8, device="cpu", **overrides).validate()
    cfg, lines = resolve_generation(cfg, cuda=False, producer="rank")
    t0 = time.time()
    engine = make_engine(cfg, path)
    print(f"  engine up in {time.time() - t0:.1f} s: {'; '.join(lines)}", flush=True)
    return engine, cfg


def prompts_of(g: torch.Generator, count: int, length: int) -> list[list[int]]:
    return [torch.randint(10, 500, (length,), generator=g).tolist() for _ in range(count)]


def timed(engine, prompts, n, new_tokens, per_call: int) -> float:
    """tokens/s generating n samples of each prompt, `per_call` prompts per engine call."""
    t0, toks = time.time(), 0
    for i in range(0, len(prompts), per_call):
        toks += sum(len(s.completion_ids) for s in engine.generate(prompts[i:i + per_call], n,
                                                                    max_new_tokens=new_tokens))
    return toks / (time.time() - t0)


def take_turns(label: str, runs: dict, repeats: int) -> dict[str, float]:
    """Each setting's median tokens/s over `repeats` rounds, the settings alternating within a round."""
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(repeats):
        for name, fn in runs.items():
            rates[name].append(fn(rep))
            print(f"  {label} {name} call {rep + 1}/{repeats}: {rates[name][-1]:.1f} tok/s", flush=True)
    return {k: statistics.median(v) for k, v in rates.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model, small sizes: seconds (the test suite's run)")
    p.add_argument("--prompts", type=int, default=8, help="prompts in a training step (the batched call's)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-prompt-tokens", type=int, default=600, help="prompt length of the prefix-cache test")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--only", choices=("batched", "prefix"), default=None, help="measure one of the two")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.long_prompt_tokens, args.repeats = 4, 8, 64, 1
    g = torch.Generator().manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_genbatch_"))
    out: dict = {"model": "tiny" if args.smoke else "qwen2.5-0.5b-shape (random weights)", "dtype": args.dtype,
                 "threads": torch.get_num_threads(), "prompts": args.prompts, "n": 8, "new_tokens": args.new_tokens,
                 "long_prompt_tokens": args.long_prompt_tokens, "repeats": args.repeats, "smoke": args.smoke}
    try:
        path = resolve_model_path("tiny") if args.smoke else str(build_qwen05b(tmp / "qwen05b"))
        on, cfg = engine_for(path, args)  # the resolver's CPU defaults: prefix caching on
        out["defaults"] = {k: getattr(cfg, k) for k in ("vllm_eager", "vllm_enable_prefix_caching", "Q_batch_size",
                                                        "vllm_gpu_memory_utilization")}
        on.generate(prompts_of(g, 2, 16), 2, max_new_tokens=4)  # warm-up
        step = cfg.Q_batch_size
        r = {"step_per_call": 1.0, "prompt_per_call": 1.0} if args.only == "prefix" else take_turns("batched", {
            "step_per_call": lambda _: timed(on, prompts_of(g, step, 24), 8, args.new_tokens, step),
            "prompt_per_call": lambda _: timed(on, prompts_of(g, step, 24), 8, args.new_tokens, 1)}, args.repeats)
        if args.only != "prefix":
            out["tok_s_step_per_call"], out["tok_s_prompt_per_call"] = round(r["step_per_call"], 1), \
                round(r["prompt_per_call"], 1)
            out["batched_speedup"] = round(r["step_per_call"] / r["prompt_per_call"], 2)
        if args.only == "batched":
            print(json.dumps(out))
            return
        off, _ = engine_for(path, args, vllm_enable_prefix_caching=False)
        off.generate(prompts_of(g, 2, 16), 2, max_new_tokens=4)
        long = args.long_prompt_tokens
        r = take_turns("prefix", {
            "cache_on": lambda _: timed(on, prompts_of(g, 1, long), 8, args.new_tokens, 1),
            "cache_off": lambda _: timed(off, prompts_of(g, 1, long), 8, args.new_tokens, 1)}, args.repeats)
        out["tok_s_cache_on"], out["tok_s_cache_off"] = round(r["cache_on"], 1), round(r["cache_off"], 1)
        out["prefix_cache_speedup"] = round(r["cache_on"] / r["cache_off"], 2)
        on.close()
        off.close()
        gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
