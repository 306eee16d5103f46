"""Benchmark: delta weight sync vs full copies at Qwen2.5-0.5B's shape, trained by real AdamW steps.

    python bench/weight_sync.py [--steps 3] [--lrs 1e-6,1e-5,1e-4] [--tokens 64] [--qwen_layers 24] [--smoke]
    python bench/weight_sync.py --relay_vs_file [--hidden 1024 --layers 8 --vocab 32000] [--repeats 5]

Default: a random-weight model of the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings; built locally, nothing downloaded) trained the way
DeepSpeed trains bf16: the module's parameters are bf16 (what rank 0 publishes), an fp32 master copy takes
the AdamW step (synthetic loss: next-token cross-entropy on random tokens) and is rounded into them. After
each step, in one run against one real ref server process on 127.0.0.1:
- delta: rank 0 publishes only what changed (common/weights/delta.py), a bf16 worker model fetches and
  applies it (server and worker rebuild the full weights and check their checksum);
- full (today's path, `--sync_delta false`): the same weights published in full, fetched and applied.
After each sync the worker's parameters are checked bit-identical to the trainer's. Printed per step:
the bytes published as a share of the full weights (a delta estimated over DELTA_MAX_SHARE of them goes
as the full copy, common/weights/delta.py: share 1), and both wall times (publish + fetch + apply, split
publish+follow).
Last line JSON: delta_share_lr1e-6 / -5 / -4 (the largest share over the steps at that lr) and
sync_speedup (full seconds / delta seconds, summed over the steps at lr 1e-6; the other lrs' as
sync_speedup_lr1e-5 / -4; sync_speedup_after_first: lr 1e-6 without its first step, whose full sync also
pays for fresh buffers). Memory: ~12 GB (bf16 model and grads, fp32 master, AdamW state, worker, publisher copy);
--qwen_layers 8: ~6 GB. The relay server gets --max_weights_mb for the model it relays.

--relay_vs_file: the older comparison (bench/weight_sync_file.py): full sync through the relay vs
writing and reading the same bytes through a local file.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import torch

from common.weights.delta import as_bits
from common.weights.sync import WeightSync
from common.wire.client import RefClient

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_lib, next to this script
from bench_lib.relay import start_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
# --smoke: the real vocabulary on a narrow 2-layer body, ~80 MB bf16: still over the default limit the relay
# server would derive from its own (tiny) model, so the smoke run checks that the bench sets one that fits
SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


def qwen05b(dtype: torch.dtype, shape: dict = QWEN05B):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, **shape)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype)


def same_bits(a, b) -> bool:
    return all(torch.equal(as_bits(x.detach()), as_bits(y.detach())) for x, y in zip(a.parameters(), b.parameters()))


class Bf16Trainer:
    """DeepSpeed's bf16 recipe in small: bf16 module, fp32 master + AdamW state, master rounded into the module."""

    def __init__(self, model, init: dict[str, torch.Tensor], lr: float, tokens: int) -> None:
        self.model, self.tokens = model, tokens
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init[n])
        self.master = [p.detach().float() for p in model.parameters()]
        for m in self.master:
            m.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.master, lr=lr, foreach=False)
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> float:
        ids = torch.randint(0, self.model.config.vocab_size, (1, self.tokens), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        for m, p in zip(self.master, self.model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                p.copy_(m)  # round to nearest bf16, as DeepSpeed's bf16 optimizer does
        return loss.item()

    def close(self) -> None:
        del self.opt, self.master


def timed(pub: WeightSync, sub: WeightSync, model, worker, version: int, delta: bool) -> tuple[float, int, str]:
    """Publish + fetch + apply of one version; returns (seconds, bytes published, the split)."""
    pub.delta = delta
    t0 = time.perf_counter()
    _, nbytes = pub.publish(model, version)
    t1 = time.perf_counter()
    assert pub.last_kind == "full" or delta, pub.last_kind  # a delta over DELTA_MAX_SHARE goes in full
    assert sub.follow(worker) == version and sub.last_kind == pub.last_kind, (sub.last_kind, pub.last_kind)
    t2 = time.perf_counter()
    assert same_bits(model, worker), f"worker differs from the trainer's v{version}"
    split = f"{t1 - t0:.2f}+{t2 - t1:.2f}"
    if delta and pub.last_kind == "full":
        split += ", sent in full: over DELTA_MAX_SHARE"
    return t2 - t0, pub.delta_bytes if pub.last_kind == "delta" else nbytes, split


def delta_study(a) -> None:
    lrs = [float(x) for x in a.lrs.split(",")]
    shape = SMOKE if a.smoke else {**QWEN05B, "num_hidden_layers": a.qwen_layers}
    model = qwen05b(torch.bfloat16, shape)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}  # the bf16 "checkpoint"
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {full_bytes / 1e6:.0f} MB bf16",
          flush=True)
    worker = qwen05b(torch.bfloat16, shape)
    srv, url = start_server(model)
    shares: dict[float, list[float]] = {}
    seconds: dict[float, list[tuple[float, float]]] = {}
    version = 0
    try:
        for lr in lrs:
            trainer = Bf16Trainer(model, init, lr, a.tokens)
            pub = WeightSync(client=RefClient(url, timeout=600), delta=True)
            sub = WeightSync(client=RefClient(url, timeout=600), delta=True)
            version += 1
            pub.publish(model, version)  # the first publish is a full copy; both start from it
            assert sub.follow(worker) == version and same_bits(model, worker)
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                loss = trainer.step()
                train_s = time.perf_counter() - t0
                version += 1
                delta_s, nbytes, delta_split = timed(pub, sub, model, worker, version, delta=True)
                version += 1  # the same weights in full: the baseline (the worker gets them in full too)
                full_s, _, full_split = timed(pub, sub, model, worker, version, delta=False)
                shares.setdefault(lr, []).append(nbytes / full_bytes)
                seconds.setdefault(lr, []).append((delta_s, full_s))
                print(f"lr {lr:g} step {step}: loss {loss:.4f} ({train_s:.1f} s); delta {nbytes / 1e6:.1f} MB = "
                      f"{100 * nbytes / full_bytes:.2f} % of {full_bytes / 1e6:.0f} MB; sync delta {delta_s:.3f} s "
                      f"({delta_split} publish+follow) vs full {full_s:.3f} s ({full_split}) = {full_s / delta_s:.1f}x;"
                      f" worker bit-identical", flush=True)
            trainer.close()
    finally:
        srv.terminate()
        srv.wait(30)
    speed = {lr: sum(f for _, f in s) / sum(d for d, _ in s) for lr, s in seconds.items()}
    print("sync speedup per lr: " + ", ".join(f"{lr:g}: {v:.2f}x" for lr, v in speed.items()))
    out = {"layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
           "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    out |= {f"delta_share_lr{lr:.0e}".replace("e-0", "e-"): round(max(shares[lr]), 5) for lr in lrs}
    out["sync_speedup"] = round(speed[lrs[0]], 3)
    later = seconds[lrs[0]][1:]  # the first step's full sync also pays for fresh buffers on every side
    if later:
        out["sync_speedup_after_first"] = round(sum(f for _, f in later) / sum(d for d, _ in later), 3)
    out.update({f"sync_speedup_lr{lr:.0e}".replace("e-0", "e-"): round(speed[lr], 3) for lr in lrs[1:]})
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="AdamW steps (and delta syncs) per learning rate")
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="learning rates, comma-separated (speedup: the first)")
    p.add_argument("--tokens", type=int, default=64, help="tokens in the synthetic loss's sequence")
    p.add_argument("--qwen_layers", type=int, default=24,
                   help="decoder layers of the Qwen2.5-0.5B-shaped model (24, its own; fewer: less memory, the same "
                        "width and vocabulary)")
    p.add_argument("--relay_vs_file", action="store_true",
                   help="the older benchmark, relay vs a local file: bench/weight_sync_file.py, which takes the "
                        "arguments after this one (see its --help)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds-long run (the test suite's): 1 step per lr on a 2-layer, hidden-256 body with the "
                        "real vocabulary")
    argv = sys.argv[1:] if argv is None else argv
    if "--relay_vs_file" in argv:
        from weight_sync_file import main as relay_vs_file  # next to this script (it imports nothing of this one)
        return relay_vs_file([x for x in argv if x != "--relay_vs_file"])
    a = p.parse_args(argv)
    if a.smoke:
        a.steps = 1
    delta_study(a)


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
