"""`python bench/weight_sync.py --relay_vs_file`: full policy weight sync through the ref server vs copying the
same bytes through a local file (the benchmark bench/weight_sync.py ran before delta sync, kept for reference).

Ours (sync_seconds): rank 0 streams the model's parameters (no joined blob) in a PUT to a real ref server
process on 127.0.0.1, and a worker-side model fetches them and copies them into its own parameters
(common/weights/sync.py) - the whole publish-and-fetch path. The weights change before every version and the
worker's copy is checked after each. From the third version on, the relay receives into the retired blob's
memory (ref_server/weights.py); best of --repeats. Baseline (file_copy_seconds): the same safetensors bytes
written to a local file, fsync'd, and read back into memory. ratio = file_copy_seconds / sync_seconds
(target >= 0.5). The last output line is one JSON object with sync_seconds, file_copy_seconds, ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.weights.blob import parameters_blob
from common.weights.sync import WeightSync
from common.wire.client import RefClient

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_lib, next to this script
from bench_lib.relay import start_server  # noqa: E402


def build_model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def relay_vs_file(a, start_server) -> None:
    model = build_model(a.hidden, a.layers, a.vocab)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"model: {sum(t.numel() for t in model.parameters()) / 1e6:.0f}M params, {nbytes / 1e6:.0f} MB float32")
    if nbytes < 500e6:
        print("warning: model is smaller than 500 MB; raise --hidden/--layers")
    worker = build_model(a.hidden, a.layers, a.vocab)
    with torch.no_grad():
        for q in worker.parameters():
            q.zero_()
    srv, url = start_server(model)  # its max_weights_mb fits this model
    try:
        pub, sub = WeightSync(client=RefClient(url, timeout=600)), WeightSync(client=RefClient(url, timeout=600))
        sync_times = []
        for version in range(1, a.repeats + 1):
            with torch.no_grad():  # new weights each version (untimed): a stale buffer cannot pass the check
                for q in model.parameters():
                    q.add_(1.0)
            t0 = time.perf_counter()
            pub.publish(model, version)
            t1 = time.perf_counter()
            assert sub.follow(worker) == version
            t2 = time.perf_counter()
            sync_times.append(t2 - t0)
            print(f"sync v{version}: publish {t1 - t0:.2f} s + fetch/apply {t2 - t1:.2f} s = {t2 - t0:.2f} s")
            same = all(torch.equal(x, y) for x, y in zip(model.parameters(), worker.parameters()))
            assert same, f"worker weights differ from the published v{version}"
    finally:
        srv.terminate()
        srv.wait(30)

    blob = parameters_blob(model)
    copy_times = []
    with tempfile.TemporaryDirectory(prefix="bench_wsync.") as tmp:
        path = Path(tmp) / "weights.safetensors"
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            back = path.read_bytes()
            copy_times.append(time.perf_counter() - t0)
            assert len(back) == len(blob)
            del back
            path.unlink()
    print(f"file copy of the same {len(blob) / 1e6:.0f} MB: best {min(copy_times):.2f} s")
    sync_s, copy_s = min(sync_times), min(copy_times)
    print(json.dumps({"sync_seconds": round(sync_s, 3), "file_copy_seconds": round(copy_s, 3),
                      "ratio": round(copy_s / sync_s, 3), "bytes": len(blob), "repeats": a.repeats}))


def main(argv: list[str] | None = None) -> None:
    """Also what `bench/weight_sync.py --relay_vs_file ARGS` runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5, help="best-of-N for both sides")
    p.add_argument("--smoke", action="store_true",
                   help="seconds-long run (the test suite's): hidden 128, 2 layers, vocab 32000, 2 repeats")
    a = p.parse_args(argv)
    if a.smoke:
        a.hidden, a.layers, a.vocab, a.repeats = 128, 2, 32000, 2
    relay_vs_file(a, start_server)


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
