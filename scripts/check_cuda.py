"""Before scripts/setup.sh installs a CUDA set: which pinned set fits this machine's NVIDIA driver, and is the torch
asked for (GRPO_TORCH) the one that set's vLLM pins? Two sets: "cuda" (constraints-cuda.txt +
requirements-vllm-cuda.txt: vLLM 0.33 on torch 2.14, CUDA 13, driver >= 580) and "cuda12" (constraints-cuda12.txt +
requirements-vllm-cuda12.txt: vLLM 0.19.1 on torch 2.10, CUDA 12.8, driver 550-579). Where none fits, it says what
to do and exits 2; it installs and downloads nothing. Standard library only: it runs before anything is installed.

    python3 scripts/check_cuda.py                          # the set for this driver (stderr says which and why)
    python3 scripts/check_cuda.py --torch "torch==2.14.0"  # GRPO_TORCH as well: it must be the set's pinned version
    python3 scripts/check_cuda.py --print-set              # and its name on stdout (cuda or cuda12): setup.sh's use

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
# The pinned CUDA sets, newest first: name -> (constraints file, vLLM requirements file, oldest driver it is used on).
# cuda12 starts at 550 (issue 42: the H100 images' 550-570 drivers), above CUDA 12's own minimum (525.60.13).
SETS = {"cuda": (CONSTRAINTS, VLLM_REQ, None), "cuda12": (REPO / "constraints-cuda12.txt",
                                                        REPO / "requirements-vllm-cuda12.txt", "550")}
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


def torch_conflict(spec: str, pin: str, vllm: str, constraints: str = "constraints-cuda.txt") -> str | None:
    """One line where GRPO_TORCH asks for another torch than the pin, else None. A local build of the pinned
    version (2.14.0+cu130) is the pinned version for pip too."""
    want = requested_version(spec)
    if want is None or want.split("+", 1)[0] == pin:
        return None
    return (f"GRPO_TORCH=\"{spec}\" conflicts with torch=={pin}, the torch {vllm} requires "
            f"({constraints}): use GRPO_TORCH=\"torch=={pin}\" (or leave it unset), or GRPO_NO_VLLM=1 to keep "
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
        msg += (f" (to >= {SETS['cuda12'][2]} for the CUDA 12 set with {CUDA12_VLLM}, which setup picks by driver), "
                f"or stay on CUDA 12 without vLLM: GRPO_NO_VLLM=1 GRPO_TORCH=\"{CUDA12_TORCH}\" bash scripts/setup.sh "
                f"(PyPI's newest CUDA 12.8 torch; gen_backend hf)")
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


def set_pins(name: str) -> tuple[str, str]:
    """(torch pin, `vllm==V`) of a pinned CUDA set."""
    constraints, vllm_req, _ = SETS[name]
    return pinned(constraints, "torch"), f"vllm=={pinned(vllm_req, 'vllm')}"


def pick_set(driver: str | None, torch_spec: str | None) -> str:
    """The newest set whose torch's CUDA this driver runs and that it is meant for (None: unknown, the newest).
    A GRPO_TORCH naming exactly one set's torch picks that set."""
    want = requested_version(torch_spec) if torch_spec else None
    for name in SETS:
        if want is not None and want.split("+", 1)[0] == set_pins(name)[0]:
            return name
    if driver is None:
        return "cuda"
    for name, (_, _, oldest) in SETS.items():
        need = MIN_DRIVER.get(int(PYPI_TORCH_CUDA.get(set_pins(name)[0], "0").split(".")[0]))
        if need is not None and _version(driver) >= _version(max(need, oldest or need, key=_version)):
            return name
    return "cuda"  # none fits: the newest set's message says what to do


def check(torch_spec: str | None) -> tuple[int, str, str]:
    """(exit code, what to print, the set's name) for the pinned CUDA sets and this machine."""
    smi, drivers, unread = shutil.which("nvidia-smi"), [], ""
    if smi is not None:
        try:
            drivers = driver_versions(smi)
        except RuntimeError as e:
            unread = str(e)
    oldest = min(drivers, key=_version) if drivers else None
    name = pick_set(oldest, torch_spec)
    pin, vllm = set_pins(name)
    files = f"{SETS[name][0].name} + {SETS[name][1].name}"
    if torch_spec:
        conflict = torch_conflict(torch_spec, pin, vllm, SETS[name][0].name)
        if conflict:
            return 2, f"[setup] {conflict}", name
    cuda = PYPI_TORCH_CUDA.get(pin)
    if cuda is None:
        return 2, f"[setup] the CUDA version of PyPI's torch=={pin} is not known: add it to PYPI_TORCH_CUDA in " \
                  f"{HERE}", name
    what, need = f"torch=={pin} (the torch {vllm} requires)", MIN_DRIVER[int(cuda.split(".")[0])]
    if smi is None:
        return 0, (f"[setup] no nvidia-smi here, so the NVIDIA driver is not checked: the {name} set ({files}); "
                   f"{what} needs >= {need}"), name
    if oldest is None:
        return 0, (f"[setup] the NVIDIA driver could not be read, so it is not checked ({unread}): the {name} set "
                   f"({files}); {what} needs >= {need}"), name
    problem = driver_problem(oldest, cuda, what)
    if problem:
        return 2, f"[setup] {problem}", name
    return 0, (f"[setup] NVIDIA driver {oldest}: the {name} set ({files}): fits {what}, built for CUDA {cuda} (needs "
               f">= {need})" + _replaced(pin)), name


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
    ap.add_argument("--print-set", action="store_true", help="print the picked set's name (cuda, cuda12) on stdout")
    a = ap.parse_args(argv)
    rc, msg, name = check(a.torch)
    print(msg, file=sys.stderr)
    if a.print_set and rc == 0:
        print(name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
