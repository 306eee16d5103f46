"""Benchmark: generated tokens per second of the vLLM engine vs HF `generate` (trainer/engines/).

    OMP_NUM_THREADS=2 python bench/generation.py [--models tiny,qwen05b] [--new-tokens 64,256] [--dtype float32]

Same prompts and settings for both engines: 16 random-id prompts (24 tokens) x 8 samples, temperature 1.0,
for each --new-tokens. Models: the embedded tiny Qwen2 and a random-weight model with the real
Qwen2.5-0.5B shape (24 layers, hidden 896, 14/2 heads, vocab 151,936, tied embeddings). Each engine
is warmed up with one short call first; engine start time is reported separately. The HF engine
generates all prompts x 8 sequences in one batch. The two engines take turns, --repeats timed calls each
per length; tok/s is the median, and so is CPU-s per 1,000 generated tokens (this process's CPU time: both engines
run in it, vLLM's in-process engine included). ratio = vLLM tok/s / HF tok/s, per model the mean over --new-tokens.
Last output line: one JSON object with tiny_ratio and qwen05b_ratio.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.config import GRPOConfig
from common.modeling import resolve_model_path

QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
               tie_word_embeddings=True, rms_norm_eps=1e-6)


def build_qwen05b(out: Path) -> Path:
    """Random weights in the Qwen2.5-0.5B shape, with the tiny model's tokenizer (ids only are used)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = Path(resolve_model_path("tiny"))
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN05B, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, out / f.name)
    del model
    gc.collect()
    return out


def run(engine, prompts, n, new_tokens) -> tuple[float, int, float]:
    """(wall s, generated tokens, CPU-s of this process: every thread; both engines run in it)."""
    t0, c0 = time.time(), time.process_time()
    samples = engine.generate(prompts, n, max_new_tokens=new_tokens)
    return time.time() - t0, sum(len(s.completion_ids) for s in samples), time.process_time() - c0


def build_engine(backend: str, path: str, prompts, args):
    """Build and warm one engine; returns (engine, start seconds)."""
    from trainer.engines import make_engine

    cfg = GRPOConfig(model=path, gen_backend=backend, temperature=1.0, top_p=1.0, gen_batch_size=len(prompts) * 8,
                     vllm_dtype=args.dtype, max_prompt_length=64, max_new_tokens=max(args.new_tokens),
                     device="cpu").validate()
    t0 = time.time()
    if backend == "hf":
        from common.modeling import eos_ids, load_model, load_tokenizer
        from trainer.engines.hf import HFEngine
        tok = load_tokenizer(path)
        model = load_model(path, device="cpu", dtype=args.hf_dtype or args.dtype)
        engine = HFEngine(model, tok, eos_ids(tok, model), temperature=1.0, top_p=1.0, top_k=0,
                          gen_batch_size=cfg.gen_batch_size)
    else:
        engine = make_engine(cfg, path)
    start = time.time() - t0
    run(engine, prompts[:2], 2, 8)  # warm-up
    return engine, start


def bench_model(path: str, prompts, args) -> dict:
    """Both engines live side by side and take turns on each timed call, so a change in the machine's load
    hits both alike; each engine's figure is the median tok/s of --repeats calls."""
    engines, res = {}, {}
    for backend in args.engines:
        engines[backend], start = build_engine(backend, path, prompts, args)
        res[backend] = {"start_s": round(start, 1)}
    for nt in args.new_tokens:
        rates: dict[str, list[float]] = {b: [] for b in engines}
        cpu: dict[str, list[float]] = {b: [] for b in engines}
        for rep in range(args.repeats):
            for backend, engine in engines.items():
                torch.manual_seed(1 + rep)
                sec, toks, cpu_s = run(engine, prompts, 8, nt)
                rates[backend].append(toks / sec)
                cpu[backend].append(1000 * cpu_s / max(1, toks))
                print(f"  {backend:4s} new_tokens={nt} call {rep + 1}/{args.repeats}: {toks} tokens in {sec:.1f} s "
                      f"= {toks / sec:.1f} tok/s", flush=True)
        for backend, r in rates.items():
            res[backend][f"tok_s_{nt}"] = round(statistics.median(r), 1)
            res[backend][f"tok_s_{nt}_calls"] = [round(x, 1) for x in r]
            res[backend][f"cpu_s_per_1k_tokens_{nt}"] = round(statistics.median(cpu[backend]), 2)
    for engine in engines.values():
        engine.close()
    engines.clear()
    gc.collect()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,qwen05b", help="comma list of tiny, qwen05b")
    p.add_argument("--new-tokens", default="64,256", help="comma list of completion lengths")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both engines)")
    p.add_argument("--hf-dtype", default=None, help="the HF engine's dtype when it differs from --dtype (e.g. an HF "
                   "worker in float32, worker_dtype float32, beside a bf16 vLLM worker)")
    p.add_argument("--engines", default="hf,vllm", help="comma list of hf, vllm (ratios need both)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine and length (median reported)")
    p.add_argument("--smoke", action="store_true", help="the test suite's short run: --models tiny --new-tokens 8 "
                                                        "--prompts 2 --repeats 1")
    args = p.parse_args()
    if args.smoke:
        args.models, args.new_tokens, args.prompts, args.repeats = "tiny", "8", 2, 1
    args.new_tokens = [int(x) for x in args.new_tokens.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    if not set(args.engines) <= {"hf", "vllm"} or not args.engines:
        p.error(f"--engines {','.join(args.engines)}: give hf, vllm or both")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (24,), generator=g).tolist() for _ in range(args.prompts)]
    out: dict = {"dtype": args.dtype, "hf_dtype": args.hf_dtype or args.dtype, "threads": torch.get_num_threads(),
                 "prompts": args.prompts, "n": 8,
                 "new_tokens": args.new_tokens, "repeats": args.repeats}
    tmp = Path(tempfile.mkdtemp(prefix="bench_gen_"))
    try:
        for name in args.models.split(","):
            path = resolve_model_path("tiny") if name == "tiny" else str(build_qwen05b(tmp / "qwen05b"))
            print(f"{name}:", flush=True)
            r = bench_model(path, prompts, args)
            out[name] = dict(r)
            if len(r) == 2:
                hf, vl = r["hf"], r["vllm"]
                ratios = [vl[f"tok_s_{nt}"] / hf[f"tok_s_{nt}"] for nt in args.new_tokens]
                out[name]["ratios"] = [round(r, 2) for r in ratios]
                out[f"{name}_ratio"] = round(sum(ratios) / len(ratios), 2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
