"""The memory estimate (common/placement/memory_plan.py) against one CPU rank's measured peak: one DeepSpeed rank (gloo,
world 1) builds the engine as trainer/deepspeed_policy.py does, takes one train_step on a synthetic batch whose rows are
all full length (prompt + completion, the estimate's worst case). The peak is the process's VmHWM (peak RSS)
of the second step (Adam's states exist), reset before it (/proc/self/clear_refs 5), less the RSS before the
model was loaded: over forward + backward and over the optimizer step apart (engine.step is wrapped to read it).
Last line: one JSON object (estimate by part, measured, ratio). CPU only: no CUDA context, no allocator cache.

    .venv/bin/python bench/memory_estimate_check.py --model tiny --rows 4 --prompt 64 --completion 64
    .venv/bin/python bench/memory_estimate_check.py --model qwen05b --rows 4 --prompt 128 --completion 128 \
        --gradient_checkpointing false            # Qwen2.5-0.5B's shape, random bf16 weights (~12 GiB)
Any GRPOConfig flag can follow (--zero_stage 3, --bf16 false, --logp_chunk_tokens 256, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
QWEN05B = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, vocab_size=151936,
               num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def qwen05b_dir(cache: Path) -> Path:
    """Qwen2.5-0.5B's shape with random bf16 weights, built once."""
    out = cache / "qwen05b-shape"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**QWEN05B, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, qwen05b or a model directory")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--cache", default=str(REPO / ".cache"))
    ap.add_argument("--smoke", action="store_true", help="the test suite's seconds-long run: --model tiny --rows 2 "
                                                         "--prompt 16 --completion 16")
    a, flags = ap.parse_known_args()
    if a.smoke:
        a.model, a.rows, a.prompt, a.completion = "tiny", 2, 16, 16
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch

    from common.config import GRPOConfig
    from common.modeling import resolve_model_path
    from common.placement.memory_plan import ModelShape, TrainSettings, activation_bytes, rank_parts, step_bytes
    from common.placement.memory_report import train_settings
    from common.settings.knobs import load_config
    from common.wire.protocol import ScoredBatch
    from trainer.deepspeed_policy import build_engine, ds_config_for, init_deepspeed
    from trainer.objective.update import train_step

    model = str(qwen05b_dir(Path(a.cache))) if a.model == "qwen05b" else resolve_model_path(a.model)
    cfg = load_config(GRPOConfig, ["--model", model, "--num_pre_Q", str(a.rows), "--max_prompt_length",
                                   str(a.prompt), "--max_new_tokens", str(a.completion), "--output_dir",
                                   str(Path(a.cache) / "memcheck-run"), *flags])
    deepspeed, _, world, on_gpu = init_deepspeed(cfg)
    base = status_kib("VmRSS")
    engine, stage, _ = build_engine(cfg, deepspeed, model, on_gpu)
    after_build = status_kib("VmRSS")
    vocab = engine.module.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B, P, T = a.rows, a.prompt, a.completion
    batch = ScoredBatch(input_ids=torch.randint(0, vocab, (B, P + T), generator=g),
                        prompt_lens=torch.full((B,), P), completion_lens=torch.full((B,), T),
                        advantages=torch.linspace(-1, 1, B), gen_logps=-torch.rand(B, T, generator=g),
                        policy_version=0, batch_id="mem", ref_logps=-torch.rand(B, T, generator=g))
    marks: list[int] = []
    inner_step = engine.step

    def step() -> None:  # the peak of forward + backward, then the peak of the optimizer step, apart
        marks.append(status_kib("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        inner_step()
        marks.append(status_kib("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")

    engine.step = step
    train_step(engine, batch, cfg)  # the first step creates Adam's states: the second is the steady state
    static = status_kib("VmRSS")
    marks.clear()
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.time()
    train_step(engine, batch, cfg)
    step_s = time.time() - t0
    fwd_bwd_peak, step_peak = marks
    shape = ModelShape.from_config(model)
    micro = min(cfg.micro_batch_size or B, B)
    settings = train_settings(cfg, ds_config_for(cfg, on_gpu), shape, world, 1, micro,
                              bool(cfg.gradient_checkpointing))
    settings = TrainSettings(**{**settings.__dict__, "adam_temp_bytes": 8, "generate_rows": 0})  # CPU torch AdamW
    parts = rank_parts(shape, settings)
    static_est = sum(v for k, v in parts.items() if k in ("weights", "gradients", "optimizer", "buffers"))
    act, stp = activation_bytes(shape, settings), step_bytes(shape, settings)
    gib = 1 << 30
    r = lambda x: round(x / gib, 3)  # noqa: E731
    out = {"model": a.model, "params_b": round(shape.params() / 1e9, 4), "zero_stage": stage, "world": world,
           "bf16": settings.bf16, "rows": B, "micro": micro, "tokens_per_row": P + T,
           "gradient_checkpointing": bool(cfg.gradient_checkpointing), "logp_chunk_tokens": cfg.logp_chunk_tokens,
           "estimate_gib": {k: r(v) for k, v in parts.items()}, "estimate_peak_gib": r(sum(parts.values())),
           "measured_peak_gib": r(max(fwd_bwd_peak, step_peak) - base),
           "static": {"estimate": r(static_est), "measured": r(static - base)},
           "fwd_bwd_peak": {"estimate": r(static_est + act), "measured": r(fwd_bwd_peak - base)},
           "step_peak": {"estimate": r(static_est + stp), "measured": r(step_peak - base)},
           "estimate_over_measured": round(sum(parts.values()) / (max(fwd_bwd_peak, step_peak) - base), 3),
           "after_build_gib": r(after_build - base), "step_s": round(step_s, 1), "base_rss_gib": r(base)}
    print(json.dumps(out))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
