"""Bytes per weight sync with LoRA (adapter tensors only) vs full weights, and the trainable fraction.

    python bench/lora_sync.py [--ranks 8,16,64]

The model is built on the meta device (no memory, no download) in Qwen2.5-0.5B's shape (its config.json
values below), wrapped with the trainer's own peft wrapping (trainer/lora/adapters.py, default target modules);
bytes are float32, as the trainer publishes them. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json

import torch


def qwen25_05b_config():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)


def measure(r: int) -> dict:
    from transformers import AutoModelForCausalLM

    from common.config import GRPOConfig
    from trainer.lora.adapters import adapter_tensors, trainable_summary, wrap_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen25_05b_config())
    full = sum(p.numel() * 4 for p in model.parameters())  # tied embedding counted once, as published
    policy = wrap_lora(model, GRPOConfig(lora_r=r, lora_alpha=2.0 * r))
    adapter = sum(t.numel() * 4 for _, t in adapter_tensors(policy))
    s = trainable_summary(policy)
    return {"lora_r": r, "trainable_params": s["trainable_params"], "trainable_fraction": s["trainable_fraction"],
            "adapter_sync_mb": adapter / 1e6, "full_sync_mb": full / 1e6, "bytes_ratio": full / adapter}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--smoke", action="store_true", help="the test suite's seconds-long run: --ranks 8")
    args = ap.parse_args()
    if args.smoke:
        args.ranks = "8"
    rows = [measure(int(r)) for r in args.ranks.split(",")]
    for row in rows:
        print(f"r={row['lora_r']}: trainable {row['trainable_params']:,} ({100 * row['trainable_fraction']:.2f} %), "
              f"sync {row['adapter_sync_mb']:.1f} MB vs full {row['full_sync_mb']:.1f} MB ({row['bytes_ratio']:.0f}x)")
    print(json.dumps({"model": "Qwen2.5-0.5B shape (random, meta device)", "results": rows}))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
