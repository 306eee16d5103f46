"""Ref server benchmarks (not a test). Prints ratios; the last line is one JSON object.

    .venv/bin/python bench/ref_scoring.py                 # both parts, defaults below
    .venv/bin/python bench/ref_scoring.py --skip-memory   # throughput only

1. Throughput: upload -> score -> get through a real server process (HTTP, safetensors,
   queues; `--in-flight` batches outstanding) against the same sequence_logprobs calls made
   in-process on the same batches. The model is a random-init Qwen2 of a few tens of M
   parameters written to a temp dir, sized so one forward takes well over 50 ms on a CPU.
   Both sides get the same torch thread count (--threads, default: half the cores, i.e. 1 on a
   2-core box; the server via OMP_NUM_THREADS); while the server runs, this client process uses
   1 torch thread and mostly waits, so the two share the cores the way a trainer and a server
   on one box would. The memory workers use --threads too.
   The server's score_token_budget is set to one batch, so it makes exactly the same calls.
   Reported: wall-clock ratio (best run of each side; runs alternate ABBA), the median of
   per-pair wall ratios, and a CPU-seconds ratio (in-process / server + client), which is the
   figure least moved by other load on a shared machine.
2. Peak memory of per-token logprobs at Qwen2.5-0.5B's LM-head shape (B=8, L=1024, H=896,
   V=151936): common.logprobs.logprobs_from_hidden (chunked) against the naive
   head(hidden).float().log_softmax(-1).gather(...), each in a fresh subprocess; the peak
   RSS increase is the max of a 2 ms psutil sampler and getrusage ru_maxrss.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.listen import free_port  # noqa: E402
from common.logprobs import logprobs_from_hidden, sequence_logprobs  # noqa: E402
from common.wire.client import RefClient  # noqa: E402
from common.wire.protocol import RolloutBatch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("throughput")
    t.add_argument("--batches", type=int, default=8, help="Timed batches per run.")
    t.add_argument("--rows", type=int, default=4, help="Rows per batch.")
    t.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens per row.")
    t.add_argument("--completion-len", type=int, default=96,
                   help="Max completion tokens per row (ragged down to half).")
    t.add_argument("--hidden", type=int, default=512, help="Model hidden size.")
    t.add_argument("--layers", type=int, default=8, help="Decoder layers.")
    t.add_argument("--vocab", type=int, default=32000, help="Vocabulary size.")
    t.add_argument("--in-flight", type=int, default=2, help="Batches uploaded but not yet fetched (>= 2).")
    t.add_argument("--repeats", type=int, default=6, help="Alternating in-process / server run pairs; best of each.")
    t.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads for scoring, the same on both sides (default: half the cores, since the "
                        "server and this client share the machine).")
    m = p.add_argument_group("memory")
    m.add_argument("--mem-batch", type=int, default=8, help="B: sequences.")
    m.add_argument("--mem-len", type=int, default=1024, help="L: positions per sequence.")
    m.add_argument("--mem-hidden", type=int, default=896, help="H: hidden size (Qwen2.5-0.5B: 896).")
    m.add_argument("--mem-vocab", type=int, default=151936, help="V: vocabulary (Qwen2.5: 151936).")
    m.add_argument("--chunk-tokens", type=int, default=256, help="chunk_tokens of logprobs_from_hidden.")
    p.add_argument("--skip-throughput", action="store_true", help="Run only the memory part.")
    p.add_argument("--skip-memory", action="store_true", help="Run only the throughput part.")
    p.add_argument("--mem-worker", choices=["ours", "naive"], help=argparse.SUPPRESS)  # internal: one measurement
    p.add_argument("--mem-out", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="The test suite's seconds-long run: both parts on toy sizes "
                                                        "(hidden 64, 1 layer, vocab 1000, 4 batches of 2 rows, 1 "
                                                        "repeat; memory B=2 L=64 H=64 V=4096).")
    a = p.parse_args(argv)
    if a.smoke:
        a.batches, a.rows, a.prompt_len, a.completion_len, a.repeats = 4, 2, 8, 16, 1
        a.hidden, a.layers, a.vocab = 64, 1, 1000
        a.mem_batch, a.mem_len, a.mem_hidden, a.mem_vocab, a.chunk_tokens = 2, 64, 64, 4096, 32
    return a


# --------------------------------------------------------------------------- throughput
def build_model(out: Path, a: argparse.Namespace) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def make_batches(n: int, a: argparse.Namespace, seed: int) -> list[RolloutBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        cl = torch.randint(a.completion_len // 2, a.completion_len + 1, (a.rows,), generator=g)
        pl = torch.full((a.rows,), a.prompt_len)
        L = a.prompt_len + a.completion_len
        ids = torch.randint(0, a.vocab, (a.rows, L), generator=g)
        ids[torch.arange(L)[None, :] >= (pl + cl)[:, None]] = 0  # right padding
        out.append(RolloutBatch(input_ids=ids, prompt_lens=pl, completion_lens=cl, advantages=torch.randn(a.rows)))
    return out


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def run_in_process(model, batches: list[RolloutBatch], threads: int) -> tuple[float, float, list[torch.Tensor]]:
    """(wall s, CPU s of this process, logps per batch)."""
    torch.set_num_threads(threads)
    me, res = psutil.Process(), []
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), cpu_seconds(me)
        for b in batches:
            res.append(sequence_logprobs(model, b.input_ids, b.prompt_lens, b.completion_lens, chunk_tokens=256)[0])
        return time.perf_counter() - t0, cpu_seconds(me) - c0, res


def run_through_server(client: RefClient, server: psutil.Process, batches: list[RolloutBatch],
                       in_flight: int) -> tuple[float, float, dict]:
    """(wall s, CPU s of server + this client process, ref_logps by batch id)."""
    torch.set_num_threads(1)
    me = psutil.Process()
    slots = threading.Semaphore(in_flight)
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def uploader() -> None:
        try:
            for b in batches:
                slots.acquire()
                client.upload(b)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0, c0 = time.perf_counter(), cpu_seconds(me) + cpu_seconds(server)
    up = threading.Thread(target=uploader)
    up.start()
    while len(got) < len(batches) and not errors:
        s = client.get(timeout=5.0)
        if s is not None:
            got[s.batch_id] = s.ref_logps
            slots.release()
    dt, cpu = time.perf_counter() - t0, cpu_seconds(me) + cpu_seconds(server) - c0
    up.join()
    if errors:
        raise errors[0]
    return dt, cpu, got


def throughput(a: argparse.Namespace) -> dict:
    from common.modeling import load_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_ref_"))
    model_dir = build_model(tmp / "model", a)
    model = load_model(str(model_dir), device="cpu", dtype="float32")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    warm, batches = make_batches(2, a, seed=1), make_batches(a.batches, a, seed=2)
    run_in_process(model, warm, a.threads)
    one = run_in_process(model, batches[:2], a.threads)[0] / 2
    print(f"[throughput] model {params:.1f}M params, batch {a.rows} x {a.prompt_len + a.completion_len} tokens, "
          f"one forward {one * 1e3:.0f} ms in-process, {a.threads} torch thread(s) each side, "
          f"{a.in_flight} batches in flight", flush=True)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    log = open(tmp / "server.log", "wb")
    budget = a.rows * (a.prompt_len + a.completion_len)  # one batch per forward: the same calls as in-process
    proc = subprocess.Popen([sys.executable, "-m", "ref_server", "--model", str(model_dir), "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--score-token-budget", str(budget)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = RefClient(f"http://127.0.0.1:{port}", timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                client.wait_ready(timeout=1)
                break
            except TimeoutError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("server did not start:\n" + (tmp / "server.log").read_text()[-3000:]) from None
        server = psutil.Process(proc.pid)
        run_through_server(client, server, warm, a.in_flight)
        t_in, t_srv, c_in, c_srv, diff = [], [], [], [], 0.0
        for i in range(a.repeats):  # alternating order (ABBA...), so drifting background load hits both alike
            for side in (("in", "srv") if i % 2 == 0 else ("srv", "in")):
                if side == "in":
                    dt, cpu, ref = run_in_process(model, batches, a.threads)
                    t_in.append(dt)
                    c_in.append(cpu)
                else:
                    dt, cpu, got = run_through_server(client, server, batches, a.in_flight)
                    t_srv.append(dt)
                    c_srv.append(cpu)
            diff = max([diff] + [(got[b.batch_id] - r).abs().max().item() for b, r in zip(batches, ref)])
        stats = client.stats()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = sum(int((b.prompt_lens + b.completion_lens).sum()) for b in batches)
    best_in, best_srv = min(t_in), min(t_srv)
    ratio = best_in / best_srv  # best of each: the runs least disturbed by anything else on the machine
    pair_median = sorted(x / y for x, y in zip(t_in, t_srv))[len(t_in) // 2]
    # CPU seconds (server + client vs in-process) barely depend on what else runs on the machine.
    cpu_ratio = sorted(c_in)[len(c_in) // 2] / sorted(c_srv)[len(c_srv) // 2]
    print(f"[throughput] in-process {tokens / best_in:,.0f} tok/s ({best_in:.2f} s), through server "
          f"{tokens / best_srv:,.0f} tok/s ({best_srv:.2f} s): ratio {ratio:.3f} (runs: in-process "
          f"{[round(x, 2) for x in t_in]}, server {[round(x, 2) for x in t_srv]}; median of per-pair ratios "
          f"{pair_median:.3f}); CPU seconds per run (median) in-process {sorted(c_in)[len(c_in) // 2]:.2f}, "
          f"server + client {sorted(c_srv)[len(c_srv) // 2]:.2f}: CPU ratio {cpu_ratio:.3f}; server forwards "
          f"{stats['forwards']}, mean scoring latency {stats['mean_scoring_latency_s'] * 1e3:.0f} ms; "
          f"max |server - in-process| {diff:.2e}; server exit code {rc}", flush=True)
    return {"throughput_ratio": round(ratio, 4), "throughput_pair_median": round(pair_median, 4),
            "throughput_cpu_ratio": round(cpu_ratio, 4),
            "throughput_max_abs_diff": diff, "forward_ms": round(one * 1e3, 1),
            "model_params_m": round(params, 1), "server_exit_code": rc}


# --------------------------------------------------------------------------- memory
def mem_worker(a: argparse.Namespace) -> None:
    """One measurement in this (fresh) process: peak RSS increase of one logprob computation."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    hidden = torch.randn(a.mem_batch, a.mem_len, a.mem_hidden)
    head = torch.nn.Linear(a.mem_hidden, a.mem_vocab, bias=False)
    targets = torch.randint(0, a.mem_vocab, (a.mem_batch, a.mem_len))
    with torch.no_grad():
        head(hidden[:1, :1]).log_softmax(-1)  # thread pools and allocator warm-up, outside the measurement
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak = [rss0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        if a.mem_worker == "ours":
            out, _ = logprobs_from_hidden(hidden, head, targets, chunk_tokens=a.chunk_tokens)
        else:
            out = head(hidden).float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    ru_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    save_file({"logps": out.contiguous()}, a.mem_out)
    print(json.dumps({"extra_bytes": max(peak[0], ru_peak) - rss0, "sampled_extra": peak[0] - rss0,
                      "ru_extra": ru_peak - rss0, "seconds": dt}))


def memory(a: argparse.Namespace) -> dict:
    from safetensors.torch import load_file

    tmp = Path(tempfile.mkdtemp(prefix="bench_mem_"))
    res, outs = {}, {}
    for kind in ("ours", "naive"):
        cmd = [sys.executable, __file__, "--mem-worker", kind, "--mem-out", str(tmp / f"{kind}.safetensors"),
               "--mem-batch", str(a.mem_batch), "--mem-len", str(a.mem_len), "--mem-hidden", str(a.mem_hidden),
               "--mem-vocab", str(a.mem_vocab), "--chunk-tokens", str(a.chunk_tokens)]
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), DS_ACCELERATOR="cpu")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"memory worker {kind} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        res[kind] = json.loads(r.stdout.strip().splitlines()[-1])
        outs[kind] = load_file(tmp / f"{kind}.safetensors")["logps"]
        print(f"[memory] {kind:5s}: peak extra RSS {res[kind]['extra_bytes'] / 2**20:,.0f} MiB "
              f"(sampler {res[kind]['sampled_extra'] / 2**20:,.0f}, ru_maxrss {res[kind]['ru_extra'] / 2**20:,.0f}) "
              f"in {res[kind]['seconds']:.1f} s", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    ratio = res["naive"]["extra_bytes"] / max(res["ours"]["extra_bytes"], 1)
    diff = (outs["ours"].double() - outs["naive"].double()).abs().max().item()
    print(f"[memory] B={a.mem_batch} L={a.mem_len} H={a.mem_hidden} V={a.mem_vocab}: naive / ours = {ratio:.1f}x, "
          f"max |ours - naive| = {diff:.2e}", flush=True)
    return {"memory_ratio": round(ratio, 2), "max_abs_diff": diff,
            "ours_peak_mib": round(res["ours"]["extra_bytes"] / 2**20, 1),
            "naive_peak_mib": round(res["naive"]["extra_bytes"] / 2**20, 1)}


def main() -> None:
    a = parse_args()
    if a.mem_worker:
        mem_worker(a)
        return
    if a.in_flight < 1:
        raise SystemExit("--in-flight must be >= 1")
    result: dict = {}
    if not a.skip_throughput:
        result.update(throughput(a))
    if not a.skip_memory:
        result.update(memory(a))
    result.setdefault("throughput_ratio", None)
    result.setdefault("memory_ratio", None)
    result.setdefault("max_abs_diff", None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
