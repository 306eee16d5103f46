"""Packed vs padded vs `auto` logprob forwards at the shapes users run (issues 33, 45), through the code the
trainer and the ref server run.

    .venv/bin/python bench/packing.py                 # the three shapes below, 5 interleaved repeats (minutes)
    .venv/bin/python bench/packing.py --smoke         # seconds: tiny sizes, 2 repeats (the suite runs this)
    .venv/bin/python bench/packing.py --layers 24 --vocab 151936 --shapes qwen_long_skewed   # the real depth/head
    .venv/bin/python bench/packing.py --dtype bfloat16 --shapes demo --tasks train            # bf16, as the demo trains
    .venv/bin/python bench/packing.py --dtype bfloat16 --math-max-len 0 ...   # torch's fused sdpa kernel throughout

Shapes (completion lengths log-normal around `median` with `sigma`, capped at `max`, fixed seed; one prompt):

  demo               the demo's tiny model (common/tiny_model.py, configs/demo.json): 32 rows (one rank's micro-batch),
                     a 30-token prompt, completions median 20, capped at 32
  qwen_short_uniform Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 KV heads, MLP 4,864, tied head), `--layers`
                     layers, `--vocab` rows of head: 32 rows, 60-token prompt, completions ~48 (sigma 0.05, cap 64)
  qwen_long_skewed   the same model: 8 rows, 100-token prompt, completions median 150, sigma 0.75, cap 512

Tasks, each (shape, task) with its model built once:

  train  common/logprobs.sequence_logprobs forward + backward (entropy on, logp_chunk_tokens as GRPOConfig's,
         gradient checkpointing as trainer/deepspeed_policy.py prepare_policy), the rows as one micro-batch
  score  ref_server/scorer.Scorer.score_rows under inference_mode (ServerConfig's chunk_tokens and budget)

each as padded (padding_free false), packed (true) and auto (common/pack_choice.py decides), the three modes
interleaved in every repeat (the order rotating) so that load on shared cores hits them alike; medians reported.
The last line is JSON: per (shape, task) the medians, auto's choice, every time; `auto_worst_slowdown` = over all
of them, the median time of the path auto chose (padded or packed) / the faster path's median - 1 (target
<= 0.05; auto's own runs, the same code as the path it chose, are timed and reported beside); `train_speedup` = padded /
packed median at qwen_long_skewed (target >= 1.3); `max_abs_diff`, the largest |packed - padded| logprob.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

MODES = ("padded", "packed", "auto")
SETTING = {"padded": "false", "packed": "true", "auto": "auto"}
SHAPES = {  # rows, prompt, median, sigma, max
    "demo": (32, 30, 20, 0.5, 32),
    "qwen_short_uniform": (32, 60, 48, 0.05, 64),
    "qwen_long_skewed": (8, 100, 150, 0.75, 512),
}
SMOKE = {"demo": (8, 10, 8, 0.5, 16), "qwen_short_uniform": (4, 8, 8, 0.05, 12),
         "qwen_long_skewed": (3, 8, 16, 0.75, 48)}


def group(shape: tuple, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, L) right-padded, prompt_lens, completion_lens) of one seeded GRPO group."""
    rows, prompt, median, sigma, cap = shape
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, generator=g, dtype=torch.float64)
    cl = torch.exp(math.log(median) + sigma * z).round().long().clamp(1, cap)
    pl = torch.full((rows,), prompt, dtype=torch.long)
    top = min(151643, vocab)  # Qwen2.5's text tokens, or the whole smaller vocabulary
    ids = torch.randint(0, top, (rows, int((pl + cl).max())), generator=g)
    ids[:, :prompt] = torch.randint(0, top, (prompt,), generator=g)
    return ids, pl, cl


def build_model(name: str, a: argparse.Namespace, train: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.config import GRPOConfig
    from common.modeling import load_model, resolve_model_path
    from trainer.deepspeed_policy import prepare_policy
    torch.manual_seed(0)
    if name == "demo":
        model = load_model(resolve_model_path("tiny"), device="cpu", dtype=a.dtype, trainable=train)
    else:
        conf = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                           num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=2,
                           rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
                           attn_implementation="sdpa")
        model = Qwen2ForCausalLM(conf).to(getattr(torch, a.dtype))
    if train:
        return prepare_policy(model, GRPOConfig(gradient_checkpointing=True))
    return model.eval().requires_grad_(False)


def measure(name: str, task: str, a: argparse.Namespace, out: list) -> None:
    """One (shape, task), its model built once: every mode's times over interleaved repeats, and its logprobs."""
    torch.set_num_threads(a.threads)
    from common.config import GRPOConfig
    from common.logprobs import sequence_logprobs
    from common.pack_choice import choose_packed
    from ref_server.config import ServerConfig
    from ref_server.scorer import Scorer, ServerMetrics
    model = build_model(name, a, train=task == "train")
    shape = (SMOKE if a.smoke else SHAPES)[name]
    ids, pl, cl = group(shape, model.config.vocab_size, a.seed)
    chunk = GRPOConfig().logp_chunk_tokens
    sc = ServerConfig()
    scorers = {m: Scorer(model, ServerMetrics(), 1, 1, sc.score_token_budget, sc.chunk_tokens,
                         padding_free=SETTING[m]) for m in MODES}
    adv = torch.linspace(-1, 1, len(cl))
    mask = torch.arange(int(cl.max()))[None] < cl[:, None]

    def once(mode: str) -> torch.Tensor:
        if task == "score":
            with torch.inference_mode():
                return scorers[mode].score_rows(ids, pl, cl)[0]
        model.zero_grad(set_to_none=True)
        packed = choose_packed(SETTING[mode], model, pl, cl, len(cl), GRPOConfig().pack_tokens)
        logps, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=chunk, with_entropy=True, padding_free=packed)
        (-(logps * adv[:, None] * mask).sum() / mask.sum()).backward()
        return logps.detach()

    times: dict[str, list[float]] = {m: [] for m in MODES}
    logps = {}
    for r in range(a.repeats * (a.score_factor if task == "score" else 1)):
        for m in MODES[r % 3:] + MODES[:r % 3]:  # rotate the order: no mode always runs first
            t0 = time.perf_counter()
            logps[m] = once(m)
            times[m].append(time.perf_counter() - t0)
    chose = "packed" if choose_packed("auto", model, pl, cl, len(cl) if task == "train" else
                                      max(1, sc.score_token_budget // int((pl + cl).max())),
                                      GRPOConfig().pack_tokens if task == "train" else sc.score_token_budget) \
        else "padded"
    out.append({"times": times, "chose": chose, "diff": float((logps["packed"] - logps["padded"]).abs().max()),
             "lens": cl.tolist(), "prompt": int(pl[0])})


def run(name: str, task: str, a: argparse.Namespace) -> dict:
    got: list = []
    measure(name, task, a, got)
    res = got[0]
    med = {m: statistics.median(v) for m, v in res["times"].items()}
    fast = min(med["padded"], med["packed"])
    # the definition: the median of the path auto chose over the faster path's median (0 when it chose
    # the faster); auto's own runs (the same code as the chosen path) are reported beside, not used
    res.update(median_s={m: round(v, 4) for m, v in med.items()}, auto_slowdown=round(med[res["chose"]] / fast - 1, 4))
    print(f"{name:18s} {task:5s} median s padded {med['padded']:.3f} packed {med['packed']:.3f} auto "
          f"{med['auto']:.3f} (chose {res['chose']}, {res['auto_slowdown']:+.3f} vs the faster); "
          f"{len(res['lens'])} rows of {res['prompt']} + {sorted(res['lens'])}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats: seconds (the test suite runs it)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--tasks", default="train,score", help="comma-separated: train, score")
    ap.add_argument("--layers", type=int, default=2, help="layers of the Qwen2.5-0.5B-shaped model (real: 24)")
    ap.add_argument("--vocab", type=int, default=32768, help="its LM head rows (real: 151,936; minutes per step here)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--score_factor", type=int, default=3, help="score: this many times --repeats (it is cheap)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the models' weights and activations (configs/demo.json trains in bf16 where the CPU has it)")
    ap.add_argument("--math-max-len", type=int, default=None,
                    help="common/packed_attention.MATH_MAX_LEN for this run: training rows up to this long use sdpa's "
                         "math kernel on CPU in bf16 (0: torch's fused kernel throughout, as before issue 45's cut)")
    a = ap.parse_args()
    if a.math_max_len is not None:
        import common.packed_attention as pa
        pa.MATH_MAX_LEN = a.math_max_len
    a.hidden, a.intermediate, a.heads = 896, 4864, 14
    if a.smoke:
        a.layers, a.vocab, a.repeats, a.hidden, a.intermediate, a.heads = 1, 512, 2, 64, 128, 4
    shapes = [s for s in a.shapes.split(",") if s]
    tasks = [t for t in a.tasks.split(",") if t]
    bad = [s for s in shapes if s not in SHAPES] + [t for t in tasks if t not in ("train", "score")]
    if bad:
        ap.error(f"unknown shape or task: {', '.join(bad)}")
    print(f"{'smoke: ' if a.smoke else ''}Qwen-shaped model {a.layers} layers, hidden {a.hidden}, head {a.vocab} rows; "
          f"{a.repeats} interleaved repeats, {a.threads} threads, {a.dtype}", flush=True)
    res = {(s, t): run(s, t, a) for s in shapes for t in tasks}
    out: dict = {
        "auto_worst_slowdown": max(r["auto_slowdown"] for r in res.values()),
        "max_abs_diff": max(r["diff"] for r in res.values()),
    }
    if ("qwen_long_skewed", "train") in res:
        med = res[("qwen_long_skewed", "train")]["median_s"]
        out["train_speedup"] = round(med["padded"] / med["packed"], 3)
    out["results"] = {f"{s}/{t}": {"median_s": r["median_s"], "auto_chose": r["chose"],
                                   "auto_slowdown": r["auto_slowdown"],
                                   "times_s": {m: [round(x, 4) for x in v] for m, v in r["times"].items()}}
                      for (s, t), r in res.items()}
    import common.packed_attention as pa
    out.update(layers=a.layers, vocab=a.vocab, repeats=a.repeats, threads=a.threads, smoke=a.smoke, dtype=a.dtype,
               math_max_len=pa.MATH_MAX_LEN)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
