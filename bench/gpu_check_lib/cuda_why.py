"""Why a torch sees no GPU, for bench/gpu_check.py: the NVIDIA driver's version and the checks scripts/setup.sh
runs before an install (scripts/check_cuda.py's table)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # check_cuda: the driver table


def nvidia_driver() -> str | None:
    """The NVIDIA driver version nvidia-smi reports (None without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    from check_cuda import driver_versions
    return min(driver_versions(smi), key=lambda v: tuple(int(p) for p in v.split(".")))


def why_no_cuda(torch_version: str, torch_cuda: str | None) -> str:
    """Why a torch sees no GPU, in words a user acts on: a CPU build, no driver, or a driver too old for the CUDA
    version that torch is built for (scripts/check_cuda.py's table, the one scripts/setup.sh checks before install)."""
    if torch_cuda is None:
        return f"torch {torch_version} is a CPU build (torch.version.cuda is None): install a CUDA build"
    from check_cuda import driver_problem
    driver = nvidia_driver()
    if driver is None:
        return f"torch {torch_version} is built for CUDA {torch_cuda}, but there is no nvidia-smi (no NVIDIA driver)"
    return driver_problem(driver, torch_cuda, f"torch {torch_version}") or \
        f"torch {torch_version} (CUDA {torch_cuda}) and NVIDIA driver {driver} fit, yet torch sees no GPU"
