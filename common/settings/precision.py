"""bf16 auto and vllm_dtype auto, resolved for the machine a process runs on (issue 62).

    cfg, line = resolve_precision(cfg, cuda=False)
    # line: "precision: float32 (bf16 auto: no native bf16 on this CPU)"

On a CPU, bf16 pays only where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX): there the demo's GRPO took
290 s against 398 s in float32; an AVX2 CPU emulates it, 3.4-3.9 s a step against 1.19-1.31 s in float32 (issue 62).
ATEN_CPU_CAPABILITY below avx512, or ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16, keeps torch's kernels off those
instructions, so they count as none. On CUDA, bf16 auto is DeepSpeed's own `auto` (bf16 where the GPU has it).
vllm_dtype auto follows the ranks on CPU (bfloat16 with bf16, else float32: the trainer's exact logprobs); on CUDA
it stays vLLM's auto (the checkpoint's dtype). worker_dtype auto (the HF worker, and what rank 0 publishes in)
follows them on CPU the same way: bfloat16 with bf16, else auto (float32 on CPU); on CUDA it stays auto (bf16 where
the GPU has it). No torch imported for a CPU (the placement CLI runs this too).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

AUTO = "auto"
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below the first with bf16 dot products (AVX512_CORE_BF16); larger ones
# (AVX512_CORE_BF16, AVX10_*, *_AMX*, DEFAULT, ALL) leave bf16 alone
ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
NATIVE_FLAGS = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX"}  # /proc/cpuinfo's names for them


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first `flags` line; none where the file is not there, e.g. macOS)."""
    path = Path(cpuinfo)
    if not path.is_file():
        return set()
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def native_bf16(env=None, flags: set[str] | None = None) -> tuple[bool, str]:
    """(whether torch on this CPU runs bf16 natively, why), the environment's caps counted."""
    env = os.environ if env is None else env
    flags = cpu_flags() if flags is None else flags
    have = [name for flag, name in NATIVE_FLAGS.items() if flag in flags]
    if not have:
        return False, "no native bf16 on this CPU"
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten and not aten.startswith("avx512"):
        return False, f"no native bf16 on this CPU (ATEN_CPU_CAPABILITY={aten}; it has {' and '.join(have)})"
    isa = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa in ONEDNN_BELOW_BF16:
        return False, f"no native bf16 on this CPU (ONEDNN_MAX_CPU_ISA={isa}; it has {' and '.join(have)})"
    return True, f"{' and '.join(have)} on this CPU"


def resolve_precision(cfg, *, cuda: bool, env=None, flags: set[str] | None = None, probe_gpu: bool = True):
    """(cfg with bf16 auto and vllm_dtype auto resolved for this device, the one log line saying the outcome).
    probe_gpu False (launch.sh's plan, which imports no torch): bf16 auto on CUDA is left to each rank."""
    bf16, why = cfg.bf16, "as set"
    if bf16 == AUTO and cuda and not probe_gpu:
        return cfg, "precision: bf16 auto (on GPUs with bf16: each rank resolves it on its GPU)"
    if bf16 == AUTO and cuda:
        import torch
        bf16, why = bool(torch.cuda.is_bf16_supported()), "this GPU " + (
            "has bf16" if torch.cuda.is_bf16_supported() else "has no bf16")
    elif bf16 == AUTO:
        bf16, why = native_bf16(env, flags)
    vllm_dtype, worker_dtype = cfg.vllm_dtype, cfg.worker_dtype
    if vllm_dtype == AUTO and not cuda:
        vllm_dtype = "bfloat16" if bf16 is True else "float32"
    if worker_dtype == AUTO and not cuda and bf16 is True:  # the HF worker too: the demo's run 0.73x the CPU-s
        # of a float32 HF worker natively (docs/benchmarks.md, "gen_backend auto")
        worker_dtype = "bfloat16"
    given = {True: "true", False: "false", None: "null", AUTO: AUTO}[cfg.bf16]
    if bf16 is None:  # ds_config's bf16.enabled decides (DeepSpeed's auto: bf16 on GPUs that have it)
        word, why = "ds_config's bf16.enabled", f"{cfg.ds_config}"
    else:
        word = "bfloat16" if bf16 else "float32"
    line = f"precision: {word} (bf16 {given}: {why})"
    if cfg.vllm_dtype == AUTO and not cuda:
        line += f"; vllm_dtype auto: {vllm_dtype}"
    if cfg.worker_dtype == AUTO and not cuda:
        line += f"; worker_dtype auto: {'bfloat16' if worker_dtype == 'bfloat16' else 'float32'}"
    return dataclasses.replace(cfg, bf16=bf16, vllm_dtype=vllm_dtype, worker_dtype=worker_dtype), line
