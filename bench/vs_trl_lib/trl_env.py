"""TRL's Python for bench/vs_trl.py: the project's own when it has trl==1.16.0 (pinned since issue 60:
project_has_trl), else (--trl-venv given, or an environment without TRL) a virtual environment created on first
use: `trl==1.16.0` from the package registry with the project's CPU torch, transformers and accelerate at the
versions the project's .venv has (the same torch wheel scripts/setup.sh installs: constraints-cpu.txt, pip's
configured index / find-links).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

TRL = "trl==1.16.0"
SAME_AS_PROJECT = ("torch", "transformers", "accelerate")  # at the project's versions: the same model code runs
STAMP = ".vs-trl-ready.json"


def wanted() -> list[str]:
    return [TRL] + [f"{name}=={metadata.version(name)}" for name in SAME_AS_PROJECT]


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def project_has_trl() -> bool:
    """The project's own environment pins trl==1.16.0 (requirements.txt, issue 60): where this Python has exactly
    that TRL, the bench runs TRL's side with it (no second environment, nothing to download: works offline)."""
    try:
        return metadata.version("trl") == TRL.split("==")[1]
    except metadata.PackageNotFoundError:
        return False


def ready(venv: Path) -> bool:
    """The venv exists and holds exactly what this bench asks for (its stamp says so)."""
    stamp = venv / STAMP
    return python_of(venv).exists() and stamp.exists() and json.loads(stamp.read_text()).get("packages") == wanted()


def ensure(venv: Path, repo: Path, log) -> Path:
    """Create or update the venv (minutes; needs the package registry) unless it is ready; its Python."""
    if ready(venv):
        return python_of(venv)
    pkgs = wanted()
    log(f"[vs_trl] creating TRL's virtual environment {venv}: {' '.join(pkgs)} (one-time, a few minutes; needs the "
        f"package registry)")
    t0 = time.time()
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python_of(venv).exists():
        subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True)
    cmd = [str(python_of(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "-c", str(repo / "constraints-cpu.txt"), *pkgs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location")][-5:]
        raise SystemExit(f"[vs_trl] could not install {' '.join(pkgs)} into {venv} (exit {proc.returncode}): "
                         f"{' | '.join(tail)}")
    (venv / STAMP).write_text(json.dumps({"packages": pkgs}) + "\n")
    log(f"[vs_trl] TRL's environment ready in {time.time() - t0:.0f} s")
    return python_of(venv)


def _base_python() -> str:
    """The interpreter the project's venv was made from (a venv is made from a base Python, not another venv)."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
