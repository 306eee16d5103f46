"""Benchmark (issue 61): the agent endpoint's generated tokens/s for a round of single-call agents, over the
engine's own batched `generate` of the same prompts.

    OMP_NUM_THREADS=2 .venv/bin/python bench/agent_endpoint.py --engine hf      # Qwen2.5-0.5B shape, random weights
    .venv/bin/python bench/agent_endpoint.py --smoke                            # the tiny model, HF, seconds

A round: --rollouts agents at once (threads, the real openai SDK), each one chat call of --new-tokens tokens at
most, through trainer/agents/ (HTTP, the batching queue, the recording). The engine figure: one
`engine.generate(prompts, 1, max_new_tokens)` of the same rendered prompts. endpoint_vs_engine = the endpoint's
tokens/s / the engine's (goal >= 0.8); each figure the median of --repeats rounds, the two taking turns, after one
warm-up round each. Also reported: the engine calls the endpoint's rounds took. Last output line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/generation.py's model builder
from generation import build_qwen05b  # noqa: E402

from common.config import GRPOConfig  # noqa: E402
from common.modeling import resolve_model_path  # noqa: E402


def qwen05b_with_template(out: Path) -> str:
    """bench/generation.py's random Qwen2.5-0.5B shape, with the tiny tokenizer's chat template too (the agents'
    requests are chat messages; that builder copies the tokenizer files only)."""
    path = build_qwen05b(out)
    for f in Path(resolve_model_path("tiny")).glob("chat_template*"):
        shutil.copy(f, path / f.name)
    return str(path)


def messages_of(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is {17 * i % 97} + {31 * i % 89}? Show your steps."}]


def engine_round(engine, prompts, new_tokens: int) -> tuple[float, int]:
    t0 = time.time()
    out = engine.generate(prompts, 1, max_new_tokens=new_tokens)
    return time.time() - t0, sum(len(s.completion_ids) for s in out)


def endpoint_round(server, rollouts: int, new_tokens: int) -> tuple[float, int]:
    import openai

    from trainer.agents.runner import run_agents

    def agent(base_url, model, prompt):
        client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
        client.chat.completions.create(model=model, messages=prompt, max_tokens=new_tokens)

    t0 = time.time()
    runs = run_agents(server, agent, [{"prompt": messages_of(i)} for i in range(rollouts)], timeout=600)
    dt = time.time() - t0
    failed = [r.error for r in runs if r.error]
    if failed:
        raise SystemExit(f"agent_endpoint: {len(failed)} agents failed, first: {failed[0]}")
    return dt, sum(r.session.sampled for r in runs)


def measure(backend: str, path: str, args) -> dict:
    from trainer.agents import serve
    from trainer.agents.chat import prompt_ids
    from trainer.engines import make_engine

    cfg = GRPOConfig(model=path, gen_backend=backend, temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens,
                     max_prompt_length=128, gen_batch_size=args.rollouts, vllm_dtype=args.dtype,
                     worker_dtype=args.hf_dtype, device="cpu").validate()
    t0 = time.time()
    engine = make_engine(cfg, path)
    print(f"  {backend} engine up in {time.time() - t0:.1f} s", flush=True)
    server = serve(engine, engine.tok, model="policy", max_new_tokens=args.new_tokens, max_prompt_length=128)
    prompts = [prompt_ids(engine.tok, messages_of(i), None) for i in range(args.rollouts)]
    rates: dict[str, list[float]] = {"engine": [], "endpoint": []}
    calls_before = server.endpoint.batcher.engine_calls
    try:
        for rep in range(args.repeats + 1):  # round 0 warms both up, untimed
            for name in ("engine", "endpoint"):
                dt, toks = engine_round(engine, prompts, args.new_tokens) if name == "engine" else \
                    endpoint_round(server, args.rollouts, args.new_tokens)
                if rep:
                    rates[name].append(toks / dt)
                print(f"  {backend} {name} round {rep}: {toks} tokens in {dt:.2f} s", flush=True)
        calls = server.endpoint.batcher.engine_calls - calls_before
    finally:
        server.close()
        engine.close()
    eng, ep = statistics.median(rates["engine"]), statistics.median(rates["endpoint"])
    return {"engine_tok_s": round(eng, 1), "endpoint_tok_s": round(ep, 1), "endpoint_vs_engine": round(ep / eng, 3),
            "endpoint_engine_calls_per_round": calls / (args.repeats + 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model, HF, small sizes: seconds (the suite's run)")
    p.add_argument("--engine", choices=("hf", "vllm", "both"), default="both")
    p.add_argument("--tiny", action="store_true", help="the demo's tiny model instead of the Qwen2.5-0.5B shape")
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="vLLM's weight dtype")
    p.add_argument("--hf-dtype", default="auto", help="the HF engine's weight dtype (worker_dtype; float32 is "
                                                      "several times faster than bfloat16 on CPU)")
    args = p.parse_args()
    if args.smoke:
        args.engine, args.tiny, args.rollouts, args.new_tokens, args.repeats = "hf", True, 8, 16, 1
    backends = ["hf", "vllm"] if args.engine == "both" else [args.engine]
    out: dict = {"model": "tiny" if args.tiny else "qwen2.5-0.5b-shape (random weights)", "rollouts": args.rollouts,
                 "new_tokens": args.new_tokens, "repeats": args.repeats, "smoke": args.smoke}
    with tempfile.TemporaryDirectory() as tmp:
        path = resolve_model_path("tiny") if args.tiny else qwen05b_with_template(Path(tmp) / "qwen05b")
        for backend in backends:
            out[backend] = measure(backend, path, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
