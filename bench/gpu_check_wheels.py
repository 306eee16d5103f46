"""Gather, here, the wheels the GPU check (bench/gpu_check.py) needs on a bare GPU machine, and say the one command
that installs them there and runs the check.

The bare machine has torch, transformers, peft, accelerate, numba and tensorboard (and what they pull in) but none
of our other pins, and no internet. The wheels to carry are our runtime pins (requirements.txt minus test/lint tools
and the parts the check does not use) with their dependency closure, minus what the machine has: the closure of the
preinstalled, as far as the image's package list (gpu_check_lib/image_packages.txt) names it; shipping a package the
machine already has would shadow its copy (the check puts ours first on PYTHONPATH). Closures come from the
installed distributions' metadata in this venv (which holds exactly our pins), markers evaluated for the target
(Linux x86_64, CPython 3.12), so the list is computed without network; only `gather` downloads.

    .venv/bin/python bench/gpu_check_wheels.py gather      # -> .whl/*.whl + .whl/manifest.json (<= 64 MiB)
    .venv/bin/python bench/gpu_check_wheels.py list        # what would be gathered (no network)
    .venv/bin/python bench/gpu_check_wheels.py command     # the one command to run on the GPU machine
    (--python-version 3.11 --python /path/python -- --device cpu --steps 2: another target, check flags)
DeepSpeed publishes no wheel (sdist only): it is built here as a pure-Python wheel (DS_BUILD_OPS=0; its ops are
JIT-built if ever used; ds_config.json asks torch's AdamW, so none is).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# read by tests/test_bench_smoke.py (ast) and printed by --help
SMOKE_EXEMPT = "no --smoke run in the test suite: `gather` needs the package registry (network)"
REPO = Path(__file__).resolve().parent.parent
WHEEL_DIR = ".whl"  # ignored by git; carried to the GPU machine with the checkout
TARGET = ".whl/site"  # where the one command installs them there
MAX_BYTES = 64 << 20
# What the lent GPU machine's image holds (the device tool's KINDS.md list, read 2026-11-17): torch, transformers, peft,
# accelerate, and the large ones our pins also pull (numba's llvmlite alone is 56 MiB; tensorboard brings grpcio,
# protobuf and pillow). Shipping our copy of one would shadow it there (ours comes first on PYTHONPATH).
PREINSTALLED = ["torch", "transformers", "peft", "accelerate", "numba", "tensorboard"]
# Every package the image holds, by name. The closure of PREINSTALLED is read from this venv's metadata, which can
# need more than the image's own copies do: only what the image names counts as already there.
IMAGE_PACKAGES = REPO / "bench" / "gpu_check_lib" / "image_packages.txt"
# Not shipped: test and lint tools, and what the check never imports (datasets/pyarrow: the check's data is the
# built-in 'arith'; matplotlib: plots; wandb, 20 MiB with its OpenTelemetry closure: the check reports to TensorBoard;
# trl, which needs datasets: imported lazily for tool runs' chat templates only, and the check runs no tool run).
NOT_SHIPPED = {"pytest", "pytest-timeout", "pytest-xdist", "execnet", "ruff", "datasets", "matplotlib", "wandb", "trl"}
PYTHON = "3.12"
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]


def target_env(py: str = PYTHON) -> dict[str, str]:
    """Marker environment of the target machine: Linux x86_64, CPython `py`."""
    return {**default_environment(), "python_version": py, "python_full_version": f"{py}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def pins(requirements: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file."""
    out = {}
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    return out


def closure(roots: list[str], requires=None, py: str = PYTHON, have: set[str] = frozenset()) -> set[str]:
    """The roots and everything they require (no extras), by the installed distributions' metadata, markers
    evaluated for the target machine. `requires(name) -> list[str] | None` (None: not installed here). A package in
    `have` is left out with what it requires: the machine's own copy brings its own needs."""
    requires, env = requires or _installed_requires, target_env(py)
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in have:
            continue
        seen.add(name)
        for spec in requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonicalize_name(req.name))
    return seen


def _installed_requires(name: str) -> list[str] | None:
    try:
        return metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return None


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    """The canonical names the GPU image holds (one per line, '#' comments)."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return {canonicalize_name(ln) for ln in lines if ln}


def to_ship(requirements: str, requires=None, version=None, py: str = PYTHON, image: set[str] | None = None
            ) -> dict[str, str]:
    """name -> version of every wheel the bare machine lacks: closure(our runtime pins) - what it has, i.e. the
    closure of the preinstalled that the image's package list names (our typer needs pydantic, the image's does
    not: the first GPU run stopped on `No module named 'pydantic'` when the whole closure was counted)."""
    version = version or (lambda n: metadata.version(n))
    roots = [n for n in pins(requirements) if n not in NOT_SHIPPED and n not in PREINSTALLED]
    have = closure(PREINSTALLED, requires, py) & (image_packages() if image is None else image)
    need = closure(roots, requires, py, have)
    return {n: version(n) for n in sorted(need)}


def install_and_run(check_args: list[str] | None = None, python: str = "python3") -> str:
    """The one command for the GPU machine, run in the checkout's root (with .whl/ carried there): bench/gpu_check.py
    installs the wheels offline into .whl/site itself (timed, within its deadline) and runs with them."""
    return " ".join([python, "bench/gpu_check.py", "--wheels", WHEEL_DIR, *map(shlex.quote, check_args or [])])


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def gather(dest: Path, ship: dict[str, str], py: str = PYTHON) -> dict:
    """Download the target's wheels (binary only, CPython 3.12, manylinux x86_64); build pure-Python wheels for
    the few packages that publish none (deepspeed). Returns the manifest (also written to dest/manifest.json)."""
    dest.mkdir(parents=True, exist_ok=True)
    plat = [f"--platform={p}" for p in PLATFORMS]
    for name, ver in ship.items():
        if any(parse_wheel_filename(f.name)[:2] == (name, Version(ver)) for f in dest.glob("*.whl")):
            continue
        try:
            _pip("download", "--no-deps", "--only-binary=:all:", f"--python-version={py}", *plat,
                 "--implementation=cp", "-d", str(dest), f"{name}=={ver}")
        except subprocess.CalledProcessError:  # no wheel published: build one (it must come out pure Python)
            _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), f"{name}=={ver}")
    wheels = sorted(dest.glob("*.whl"))
    files = {f.name: f.stat().st_size for f in wheels}
    impure = [f for f in files if not fits_target(f, py)]
    missing = [n for n in ship if not any(name_of(f) == n for f in files)]
    total = sum(files.values())
    manifest = {"python": py, "platforms": PLATFORMS, "packages": ship, "files": files, "total_bytes": total,
                "total_mib": round(total / 2**20, 2)}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if missing or impure:
        raise SystemExit(f"wheels missing for {missing}, or built for this machine only: {impure}")
    if total > MAX_BYTES:
        raise SystemExit(f"{total / 2**20:.1f} MiB of wheels, over the {MAX_BYTES >> 20} MiB budget")
    return manifest


def name_of(wheel_file: str) -> str:
    return parse_wheel_filename(wheel_file)[0]


def fits_target(wheel_file: str, py: str = PYTHON) -> bool:
    """Installable on the target (CPython `py`, manylinux x86_64): not, e.g., a wheel built here for 3.11."""
    ver, cp = tuple(int(v) for v in py.split(".")), "cp" + py.replace(".", "")
    plats = [f"manylinux_2_{m}_x86_64" for m in range(5, 40)] + [f"manylinux{y}_x86_64" for y in (1, 2010, 2014)]
    target = set(cpython_tags(ver, abis=[cp], platforms=plats)) | \
        set(compatible_tags(ver, interpreter=cp, platforms=plats))
    return bool(set(parse_wheel_filename(wheel_file)[3]) & target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=SMOKE_EXEMPT)
    ap.add_argument("what", choices=["gather", "list", "command"])
    ap.add_argument("--dest", default=str(REPO / WHEEL_DIR))
    ap.add_argument("--python-version", default=PYTHON, help="the GPU machine's Python (default %(default)s)")
    ap.add_argument("--python", default="python3", help="its interpreter, in the printed command")
    argv = sys.argv[1:]
    check_args = argv[argv.index("--") + 1:] if "--" in argv else []  # bench/gpu_check.py flags for the command
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    ship = to_ship((REPO / "requirements.txt").read_text(), py=a.python_version)
    if a.what == "list":
        print("\n".join(f"{n}=={v}" for n, v in ship.items()))
    elif a.what == "gather":
        os.environ.setdefault("DS_BUILD_OPS", "0")
        m = gather(Path(a.dest), ship, a.python_version)
        print(f"{len(m['files'])} wheels, {m['total_mib']} MiB in {a.dest}; on the GPU machine, in the checkout:",
              file=sys.stderr)
        print(install_and_run(check_args, a.python))
    else:
        print(install_and_run(check_args, a.python))


if __name__ == "__main__":
    main()
