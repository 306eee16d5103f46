"""The CPU a bench/vs_trl.py run measured on (its docs table says which CPU each row is from): the model name, the
flags that decide the kernels (AVX2, AVX-512, AVX-512 BF16, AMX), the caps in the environment that emulate a smaller
CPU, and what bf16 auto resolves to there (common/settings/precision.py)."""
from __future__ import annotations

import os
from pathlib import Path

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni")
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
    from common.settings.precision import cpu_flags, native_bf16

    model = "unknown (no /proc/cpuinfo)"
    path = Path(cpuinfo)
    if path.is_file():
        names = [line.partition(":")[2].strip() for line in path.read_text(errors="replace").splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else "unknown (no model name in /proc/cpuinfo)"
    flags = cpu_flags(cpuinfo)
    native, why = native_bf16()
    return dict(model=model, cores=os.cpu_count(), flags=[f for f in KERNEL_FLAGS if f in flags],
                caps={k: os.environ[k] for k in CAPS if k in os.environ},
                bf16=f"bf16 auto: {'bfloat16' if native else 'float32'} ({why})", all_flags=sorted(flags))
