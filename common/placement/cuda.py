"""Whether this environment's torch can use a GPU, without importing torch where its build already says no.

    python -m common.placement.cuda     exit 0: torch sees a CUDA (or ROCm) GPU; 1: it does not (or no torch)

launch.sh asks this before anything starts (no GPU: DeepSpeed on CPU) and the placement plan counts GPUs with it
when there is no nvidia-smi. `import torch` costs ~1.5 CPU-s; a CPU build (torch/version.py: cuda and hip None,
as `pip install torch` from the CPU index gives) can see no GPU, so there the answer is read from that file. A CUDA
or ROCm build, or a version file this cannot read, asks torch itself.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def gpu_build() -> bool | None:
    """False: torch is missing or built for neither CUDA nor ROCm; True: it is built for one (the GPU may still be
    absent); None: its torch/version.py does not say (then only torch knows)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not spec.origin:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    found = {}
    for node in tree.body:  # `cuda: Optional[str] = None` / `hip = '6.2...'`
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and isinstance(node.value, ast.Constant):
            found[target.id] = node.value.value
    if set(found) != {"cuda", "hip"}:
        return None
    return found["cuda"] is not None or found["hip"] is not None


def device_count() -> int:
    """torch.cuda.device_count(), 0 without importing torch for a CPU build."""
    if gpu_build() is False:
        return 0
    import torch
    return torch.cuda.device_count()


def available() -> bool:
    """torch.cuda.is_available(), False without importing torch for a CPU build (or no torch)."""
    if gpu_build() is False:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(0 if available() else 1)
