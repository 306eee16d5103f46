"""Padded vs padding-free logprob forwards (issue 33), through the code the trainer and the ref server run.

    .venv/bin/python bench/packing.py [--layers 8] [--repeats 2] [--threads 2] [--pack_tokens 4096]
    .venv/bin/python bench/packing.py --rows 32 --median 500 --max 600 --tasks train  # a long micro-batch

Model: Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 KV heads, MLP 4,864, vocabulary 151,936, tied embedding),
`--layers` layers, random weights (seeded: every measuring process builds the same model), float32.
Batch: one GRPO group, `--rows` completions after the same `--prompt`-token prompt; completion lengths log-normal
(median `--median`, sigma `--sigma`, capped at `--max` = max_new_tokens), fixed seed.

  train  common/logprobs.sequence_logprobs forward + backward (the ranks' training forward: entropy on,
         logp_chunk_tokens and gradient checkpointing as GRPOConfig's, trainer/engine.py prepare_policy)
  score  ref_server/scorer.Scorer.score_rows under inference_mode (ServerConfig's chunk_tokens and
         score_token_budget), the ref server's own scoring

each padded (padding_free false: right-padded to the longest row) and padding-free (train: packs of at most
`--pack_tokens` tokens as the trainer makes them, 0 = the whole group as one pack; score: the ref server's
score_token_budget), every
(task, mode) in its own fresh process so that its peak memory is its own (peak RSS above the process's RSS
before the task, sampled every 5 ms). Times: the best of `--repeats` runs. The last line is JSON with
train_speedup, score_speedup (padded s / padding-free s), padding_share_before (padded tokens / computed tokens of
the padded forward) and max_abs_diff (largest |padded - padding-free| per-token logprob, train and score).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import torch  # noqa: E402

GRAD_PARAMS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight")


def group(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, L) right-padded, prompt_lens, completion_lens) of one seeded group."""
    g = torch.Generator().manual_seed(a.seed)
    z = torch.randn(a.rows, generator=g, dtype=torch.float64)
    cl = torch.exp(math.log(a.median) + a.sigma * z).round().long().clamp(1, a.max)
    pl = torch.full((a.rows,), a.prompt, dtype=torch.long)
    top = min(151643, a.vocab)  # Qwen2.5's text tokens, or the whole smaller --vocab
    ids = torch.randint(0, top, (a.rows, int((pl + cl).max())), generator=g)
    prompt = torch.randint(0, top, (a.prompt,), generator=g)
    ids[:, :a.prompt] = prompt  # one prompt, several completions: a GRPO group
    return ids, pl, cl


def build_model(a: argparse.Namespace, train: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.config import GRPOConfig
    from trainer.engine import prepare_policy
    torch.manual_seed(0)
    conf = Qwen2Config(vocab_size=a.vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=a.layers,
                       num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(conf)
    if train:
        return prepare_policy(model, GRPOConfig(gradient_checkpointing=True))
    return model.eval().requires_grad_(False)


class PeakRSS:
    """Peak RSS above the RSS at start, sampled in a thread (torch's kernels release the GIL)."""

    def __init__(self) -> None:
        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def measure(task: str, packed: bool, a: argparse.Namespace, out: mp.Queue) -> None:
    """One (task, mode) in this fresh process: times of each repeat, peak memory, logprobs (and a few grads)."""
    torch.set_num_threads(a.threads)
    from common.config import GRPOConfig
    from common.logprobs import sequence_logprobs
    from ref_server.config import ServerConfig
    from ref_server.scorer import Scorer, ServerMetrics
    ids, pl, cl = group(a)
    model = build_model(a, train=task == "train")
    times, res = [], {}
    if task == "train":
        chunk = GRPOConfig().logp_chunk_tokens
        adv = torch.linspace(-1, 1, a.rows)
        mask = torch.arange(int(cl.max()))[None] < cl[:, None]
        with PeakRSS() as peak:
            for _ in range(a.repeats):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                logps, _ = sequence_logprobs(model, ids, pl, cl, chunk_tokens=chunk, with_entropy=True,
                                             padding_free=packed, pack_tokens=a.pack_tokens or None)
                (-(logps * adv[:, None] * mask).sum() / mask.sum()).backward()
                times.append(time.perf_counter() - t0)
        named = dict(model.named_parameters())
        res["grads"] = {n: named[n].grad.numpy().copy() for n in GRAD_PARAMS}
    else:
        sc = ServerConfig()
        scorer = Scorer(model, ServerMetrics(), 1, 1, sc.score_token_budget, sc.chunk_tokens, padding_free=packed)
        with PeakRSS() as peak, torch.inference_mode():
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                logps, computed = scorer.score_rows(ids, pl, cl)
                times.append(time.perf_counter() - t0)
        res["computed"] = computed
    # numpy, not tensors: torch would share a tensor's storage with the parent through this process, gone at exit
    out.put({"times": times, "peak_mb": peak.mb, "logps": logps.detach().float().numpy().copy(), **res})


def run(task: str, packed: bool, a: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=measure, args=(task, packed, a, q))
    p.start()
    res = q.get()
    p.join()
    res["logps"] = torch.from_numpy(res["logps"])
    res["grads"] = {n: torch.from_numpy(g) for n, g in res.get("grads", {}).items()}
    if p.exitcode != 0:
        raise RuntimeError(f"{task} padding_free={packed} exited {p.exitcode}")
    mode = "padding-free" if packed else "padded"
    print(f"{task:5s} {mode:12s} best {min(res['times']):7.2f} s of {[round(t, 2) for t in res['times']]}, "
          f"peak +{res['peak_mb']:.0f} MiB", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--median", type=float, default=150)
    ap.add_argument("--sigma", type=float, default=0.75)
    ap.add_argument("--max", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--pack_tokens", type=int, default=4096, help="train: tokens per pack (0: one pack)")
    ap.add_argument("--vocab", type=int, default=151936, help="a smaller LM head (the head dominates at long rows)")
    ap.add_argument("--tasks", default="train,score", help="comma-separated: train, score")
    a = ap.parse_args()
    tasks = [t for t in ("train", "score") if t in a.tasks.split(",")]

    from common.packing import forward_tokens, padding_share
    ids, pl, cl = group(a)
    computed, real = forward_tokens(pl, cl, packed=False)
    share = padding_share(computed, real)
    print(f"group: {a.rows} completions of {sorted(cl.tolist())} tokens after a {a.prompt}-token prompt; padded "
          f"{computed} tokens for {real} real (padding share {share:.3f}); {a.layers} layers, {a.threads} threads",
          flush=True)
    r = {(t, p): run(t, p, a) for t in tasks for p in (False, True)}
    best = {k: min(v["times"]) for k, v in r.items()}
    out: dict = {"padding_share_before": round(share, 4),
                 "max_abs_diff": max(float((r[(t, True)]["logps"] - r[(t, False)]["logps"]).abs().max())
                                     for t in tasks)}
    for t in tasks:  # speedup = padded s / padding-free s
        out[f"{t}_speedup"] = round(best[(t, False)] / best[(t, True)], 3)
        out[f"{t}_s"] = {"padded": round(best[(t, False)], 3), "padding_free": round(best[(t, True)], 3)}
    if "train" in tasks:
        out["grad_max_rel_diff"] = max(float((r[("train", True)]["grads"][n] - r[("train", False)]["grads"][n])
                                             .abs().max() / r[("train", False)]["grads"][n].abs().max())
                                       for n in GRAD_PARAMS)
    if "score" in tasks:
        out["score_computed_tokens"] = {"padded": r[("score", False)]["computed"],
                                        "padding_free": r[("score", True)]["computed"]}
    print(json.dumps({
        **out, "peak_mb": {f"{t}_{'padding_free' if p else 'padded'}": round(v["peak_mb"]) for (t, p), v in r.items()},
        "completion_lens": cl.tolist(), "prompt_len": a.prompt, "rows": a.rows, "layers": a.layers,
        "threads": a.threads, "pack_tokens": a.pack_tokens, "vocab": a.vocab,
    }))


if __name__ == "__main__":
    main()
