"""Before scripts/setup.sh installs the CUDA set: is the torch asked for (GRPO_TORCH) the one vLLM pins, and is this
machine's NVIDIA driver new enough for the CUDA version that torch's wheels are built for? Where not, it says what to
do and exits 2; it installs and downloads nothing. Standard library only: it runs before anything is installed.

    python3 scripts/check_cuda.py                          # the pinned torch (constraints-cuda.txt) vs the driver
    python3 scripts/check_cuda.py --torch "torch==2.14.0"  # GRPO_TORCH as well: it must be the pinned version

The driver comes from `nvidia-smi --query-gpu=driver_version --format=csv,noheader` (one line per GPU).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "constraints-cuda.txt"
VLLM_REQ = REPO / "requirements-vllm-cuda.txt"
HERE = "scripts/check_cuda.py"
# The CUDA version PyPI's Linux x86_64 wheels of a torch release are built for, as the wheel's own requirements name
# it (torch 2.14.0 requires cuda-toolkit==13.0.3; 2.10.0 nvidia-cuda-runtime-cu12==12.8.90). The registry test in
# tests/test_cuda_install.py checks the entry of the pinned torch against PyPI.
PYPI_TORCH_CUDA = {"2.14.0": "13.0", "2.10.0": "12.8"}
# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA release notes, "minimum required driver version for
# CUDA minor version compatibility"): a wheel built for any 13.x needs >= 580, any 12.x >= 525.60.13.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580"}
# For a driver in [525.60.13, 580): PyPI's newest torch built for CUDA 12, and the newest vLLM that pins it.
CUDA12_TORCH, CUDA12_VLLM = "torch==2.10.0", "vllm==0.19.1"


def pinned(path: Path, name: str) -> str:
    """The version `name==V` pins in a requirements/constraints file."""
    for line in path.read_text().splitlines():
        m = re.fullmatch(rf"\s*{re.escape(name)}\s*==\s*(\S+)\s*", line.split("#", 1)[0])
        if m:
            return m.group(1)
    raise SystemExit(f"[setup] {path.name} pins no {name}==<version>")


def requested_version(spec: str) -> str | None:
    """The torch version a GRPO_TORCH value asks for exactly (`torch==V`, or a wheel file/URL named torch-V-...),
    None where it names none (`torch`, a range: pip then holds it to the pin)."""
    spec = spec.strip()
    m = re.fullmatch(r"torch\s*(?:\[[^\]]*\])?\s*(?:==\s*([0-9][^\s;,]*))?", spec)
    if m:
        return m.group(1)
    m = re.search(r"(?:^|[/=@\s])torch-([0-9][^-]*)-[^/]*\.whl$", spec)
    return m.group(1).replace("%2B", "+") if m else None


def torch_conflict(spec: str, pin: str, vllm: str) -> str | None:
    """One line where GRPO_TORCH asks for another torch than the pin, else None. A local build of the pinned
    version (2.14.0+cu130) is the pinned version for pip too."""
    want = requested_version(spec)
    if want is None or want.split("+", 1)[0] == pin:
        return None
    return (f"GRPO_TORCH=\"{spec}\" conflicts with torch=={pin}, the torch {vllm} requires "
            f"(constraints-cuda.txt): use GRPO_TORCH=\"torch=={pin}\" (or leave it unset), or GRPO_NO_VLLM=1 to keep "
            f"your torch without vLLM")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def driver_problem(driver: str, cuda: str, what: str) -> str | None:
    """What to do where NVIDIA driver `driver` is too old for CUDA `cuda` (what: the wheel built for it), else None."""
    major = int(cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    if need is None:
        return f"no minimum NVIDIA driver known for CUDA {cuda} ({what}): add it to MIN_DRIVER in {HERE}"
    if _version(driver) >= _version(need):
        return None
    msg = (f"NVIDIA driver {driver} is too old for {what}, built for CUDA {cuda}: CUDA {major}.x needs a "
           f"driver >= {need}. Upgrade the driver")
    if major == 13 and _version(driver) >= _version(MIN_DRIVER[12]):
        msg += (f", or stay on CUDA 12 (driver >= {MIN_DRIVER[12]}): without vLLM, "
                f"GRPO_NO_VLLM=1 GRPO_TORCH=\"{CUDA12_TORCH}\" bash scripts/setup.sh (PyPI's newest CUDA 12.8 torch; "
                f"gen_backend hf); {CUDA12_VLLM} is the newest vLLM pinning it (not tested with this project)")
    return msg + "."


def driver_versions(smi: str) -> list[str]:
    """The driver version nvidia-smi reports for each GPU (they are one driver; a list keeps the check honest)."""
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60)
    found = [v.strip() for v in out.stdout.splitlines() if re.fullmatch(r"\d+(\.\d+)*", v.strip())]
    if out.returncode != 0 or not found:
        raise RuntimeError(f"`{smi} --query-gpu=driver_version --format=csv,noheader` exit {out.returncode}: "
                           f"{(out.stderr or out.stdout).strip()[:200]!r}")
    return found


def check(torch_spec: str | None) -> tuple[int, str]:
    """(exit code, what to print) for the pinned CUDA set and this machine."""
    pin, vllm = pinned(CONSTRAINTS, "torch"), f"vllm=={pinned(VLLM_REQ, 'vllm')}"
    if torch_spec:
        conflict = torch_conflict(torch_spec, pin, vllm)
        if conflict:
            return 2, f"[setup] {conflict}"
    cuda = PYPI_TORCH_CUDA.get(pin)
    if cuda is None:
        return 2, f"[setup] the CUDA version of PyPI's torch=={pin} is not known: add it to PYPI_TORCH_CUDA in {HERE}"
    what, need = f"torch=={pin} (the torch {vllm} requires)", MIN_DRIVER[int(cuda.split(".")[0])]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, f"[setup] no nvidia-smi here, so the NVIDIA driver is not checked: {what} needs >= {need}"
    try:
        drivers = driver_versions(smi)
    except RuntimeError as e:
        return 0, f"[setup] the NVIDIA driver could not be read, so it is not checked ({e}): {what} needs >= {need}"
    oldest = min(drivers, key=_version)
    problem = driver_problem(oldest, cuda, what)
    if problem:
        return 2, f"[setup] {problem}"
    return 0, f"[setup] NVIDIA driver {oldest}: fits {what}, built for CUDA {cuda} (needs >= {need})" + _replaced(pin)


def _replaced(pin: str) -> str:
    """Where the venv running this holds another torch, say that the install replaces it."""
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""
    return "" if have.split("+", 1)[0] == pin else f"; torch {have} in this venv is replaced by torch=={pin}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch", default=None, help="GRPO_TORCH as the user set it")
    rc, msg = check(ap.parse_args(argv).torch)
    print(msg, file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
