"""The GPU check's two measurements, in one process of their own (bench/gpu_check.py starts it):

- `update`: ZeRO-3 against ZeRO-2 on one update. One rank (world 1; NCCL on CUDA, gloo on CPU) builds a DeepSpeed
  engine on the model at stage 2, then at stage 3, from the same fp32 weights, with plain SGD (lr --lr, no clipping),
  and trains one 8-row batch in micro-batches of 3 + 3 + 2 (padding_free true) through the trainer's own
  train_update. zero3_vs_zero2_rel_diff = ||dW3 - dW2|| / ||dW2|| over every weight. In fp32 at lr >= 1e-3 a wrong
  update (one micro-batch's gradient instead of the sum, issue 30) moves it to O(1); a bf16 update at lr 1e-6 would
  hide under rounding.
- `hf`: the reference: a plain Hugging Face forward + backward loop (no DeepSpeed, no GRPO, no optimizer) on the
  same model and shape, rows x seq tokens per pass: tokens/s and, on a GPU whose peak is known, MFU
  (6 x parameters x tokens/s over the peak dense bf16 FLOP/s).

    python bench/gpu_check_lib/probe.py MODEL_DIR --device cpu [--out DIR] [--lr 0.01] [--prompt 6 --completion 9]
        [--rows 8 --seq 64 --seconds 5] [--only update|hf]      (both in one process; last line JSON)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
ROWS, MICRO = 8, 3  # 3 + 3 + 2: DeepSpeed accumulates 3 micro-batches into the one update
PEAK_BF16_TFLOPS = {"H100 SXM": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4,
                    "GH200": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0}  # dense, vendor data sheets


def peak_tflops(device_name: str) -> float | None:
    """The data-sheet peak of a GPU by its name (the longest matching key), None when unknown (CPUs)."""
    hits = [k for k in PEAK_BF16_TFLOPS if k.lower() in device_name.lower()]
    return PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else None


def make_batch(vocab: int, prompt: int, completion: int, device: str, seed: int = 0):
    """8 ragged rows (prompt up to `prompt`, completion up to `completion` tokens), advantages of both signs,
    engine/ref logprobs near a random model's (-log vocab), so the clipped ratio leaves most tokens a gradient."""
    from common.wire.protocol import ScoredBatch
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(max(prompt // 2, 1), prompt + 1, (ROWS,), generator=g)
    clen = torch.randint(max(completion // 4, 1), completion + 1, (ROWS,), generator=g)
    ids = torch.zeros(ROWS, int((plen + clen).max()), dtype=torch.long)
    for i in range(ROWS):
        ids[i, :plen[i] + clen[i]] = torch.randint(3, vocab, (int(plen[i] + clen[i]),), generator=g)
    T, base = int(clen.max()), -math.log(vocab)
    return ScoredBatch(ids, plen, clen, torch.randn(ROWS, generator=g),
                       gen_logps=base - torch.rand(ROWS, T, generator=g) * 0.2,
                       ref_logps=base - torch.rand(ROWS, T, generator=g) * 0.2)


def one_update(deepspeed, model_dir: str, stage: int, a) -> dict:
    """The weights' change (fp32, on the device) after one SGD update at `stage`."""
    from common.config import GRPOConfig
    from common.modeling import load_model
    from trainer.deepspeed_policy import ds_config_for, initialize, prepare_policy
    from trainer.objective.update import new_round, train_update
    cfg = GRPOConfig(model=model_dir, num_pre_Q=ROWS, micro_batch_size=MICRO, max_new_tokens=a.completion,
                     grad_clip=1e9, beta=0.04, bf16=False, padding_free="true").validate()
    on_gpu = a.device == "cuda"
    ds = ds_config_for(cfg, on_gpu=on_gpu)
    assert ds["gradient_accumulation_steps"] == 3, ds  # the 3 micro-batches are one optimizer step
    ds["zero_optimization"]["stage"] = stage
    ds.pop("optimizer")
    ds["zero_allow_untested_optimizer"] = True  # plain SGD: the update is -lr x the accumulated gradient
    torch.manual_seed(0)
    model = prepare_policy(load_model(model_dir, device=a.device, dtype="float32", trainable=True), cfg)
    params = list(model.parameters())
    engine, *_ = initialize(deepspeed, ds, model=model, model_parameters=params,
                            optimizer=torch.optim.SGD(params, lr=a.lr))
    named = list(engine.module.named_parameters())
    z3 = hasattr(named[0][1], "ds_id")
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=z3):
        before = {n: p.detach().float().clone() for n, p in named}
    b = make_batch(engine.module.config.vocab_size, a.prompt, a.completion, a.device)
    train_update(engine, new_round([b], cfg, a.device), cfg)
    steps = engine.global_steps
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=z3):
        delta = {n: before[n] - p.detach().float() for n, p in named}
    engine.destroy()
    del engine, model, params, before
    if on_gpu:
        torch.cuda.empty_cache()
    return {"delta": delta, "global_steps": steps}


def update_probe(a) -> dict:
    import deepspeed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if a.device == "cpu":  # gloo, as the trainer on CPU
        from trainer.deepspeed_policy import skip_shm_op
        skip_shm_op(deepspeed)
    deepspeed.init_distributed(dist_backend="nccl" if a.device == "cuda" else "gloo")
    t0 = time.time()
    two = one_update(deepspeed, a.model, 2, a)
    three = one_update(deepspeed, a.model, 3, a)
    num = den = 0.0
    for n, d2 in two["delta"].items():
        num += float((three["delta"][n].double() - d2.double()).pow(2).sum())
        den += float(d2.double().pow(2).sum())
    torch.distributed.destroy_process_group()
    return {"zero3_vs_zero2_rel_diff": math.sqrt(num / den) if den else None, "update_norm": math.sqrt(den),
            "lr": a.lr, "optimizer": "SGD (plain)", "dtype": "float32", "rows": ROWS,
            "micro_batches": "3 + 3 + 2", "padding_free": True,
            "optimizer_steps": [two["global_steps"], three["global_steps"]], "probe_s": round(time.time() - t0, 1)}


def hf_loop(a) -> dict:
    """Forward + backward of the plain HF model, `rows` x `seq` random tokens per pass, for about `seconds`."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).train()
    params = sum(p.numel() for p in model.parameters())  # tied embedding counted once: the LM head's matmul
    ids = torch.randint(3, model.config.vocab_size, (a.rows, a.seq), device=a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, allocator
    sync()
    t0, n = time.time(), 0
    while n < 2 or time.time() - t0 < a.seconds:
        step()
        n += 1
    sync()
    dt = time.time() - t0
    tps = n * a.rows * a.seq / dt
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    peak = peak_tflops(name) if a.device == "cuda" else None
    out = {"tokens_per_s": round(tps, 1), "passes": n, "rows": a.rows, "seq": a.seq, "dtype": str(dtype),
           "params": params, "model_tflops": round(6 * params * tps / 1e12, 3), "peak_tflops": peak,
           "mfu": round(6 * params * tps / (peak * 1e12), 4) if peak else None}
    if peak is None:
        out["mfu_note"] = f"no data-sheet peak for {name!r}: MFU not computed"
    if a.device == "cuda":
        out["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    return out


def write(out: Path | None, name: str, doc: dict) -> None:
    """One result file, written whole the moment it is known (aside, then renamed)."""
    if out is not None:
        tmp = out / f".{name}.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.rename(out / f"{name}.json")


def main() -> None:
    # A cut (bench/gpu_check.py's deadline) sends TERM: leave through `finally` blocks, so a lock held at that moment
    # is released (DeepSpeed's CPU init JIT-loads its shm op under torch's file baton, and a baton left behind by a
    # killed process makes every later DeepSpeed CPU process on the machine wait for it forever).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default=None, help="write probe-update.json and probe-hf.json here as each finishes")
    ap.add_argument("--only", choices=["update", "hf"], default=None, help="one of the two (default: both)")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate of the update probe (>= 1e-3)")
    ap.add_argument("--prompt", type=int, default=6, help="update probe: longest prompt of the batch")
    ap.add_argument("--completion", type=int, default=9, help="update probe: longest completion")
    ap.add_argument("--rows", type=int, default=8, help="hf loop: rows per pass")
    ap.add_argument("--seq", type=int, default=64, help="hf loop: tokens per row")
    ap.add_argument("--seconds", type=float, default=5.0, help="hf loop: how long to time it")
    a = ap.parse_args()
    if a.lr < 1e-3:
        raise SystemExit(f"--lr {a.lr}: the probe needs lr >= 1e-3 (below, a wrong update hides under rounding)")
    out, res = Path(a.out) if a.out else None, {}
    for what, fn in (("update", update_probe), ("hf", hf_loop)):  # one process: torch and DeepSpeed imported once
        if a.only in (None, what):
            t = time.time()
            res[what] = {**fn(a), "wall_s": round(time.time() - t, 1)}
            write(out, f"probe-{what}", res[what])
            print(f"[probe] {what}: {json.dumps(res[what])}", file=sys.stderr, flush=True)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
