"""The CUDA install: torch pinned to what vLLM pins (constraints-cuda.txt), the NVIDIA driver checked against that
torch's CUDA version before anything is installed (scripts/check_cuda.py, the entry point scripts/setup.sh calls, with
a fake `nvidia-smi` on PATH), setup.sh's own steps run with a venv whose python records pip instead of running it,
and, marked `registry` (-m registry; not in CI), the resolution of the CUDA set against the package registry."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import REPO

CHECK = REPO / "scripts" / "check_cuda.py"
sys.path.insert(0, str(REPO / "scripts"))
import check_cuda  # noqa: E402  (scripts/ is no package: setup.sh runs it as a file)

PIN = check_cuda.pinned(REPO / "constraints-cuda.txt", "torch")
VLLM = check_cuda.pinned(REPO / "requirements-vllm-cuda.txt", "vllm")
PIN12 = check_cuda.pinned(REPO / "constraints-cuda12.txt", "torch")
VLLM12 = check_cuda.pinned(REPO / "requirements-vllm-cuda12.txt", "vllm")


def fake_smi(tmp_path, driver: str | None, gpus: int = 2):
    """A directory holding an `nvidia-smi` that lists `gpus` H100s and reports `driver` for each (None: the query
    fails as it does when the driver cannot be reached)."""
    d = tmp_path / "smi"
    d.mkdir(exist_ok=True)
    listing = "".join(f"  echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})'\n" for i in range(gpus))
    query = "".join(f"  echo {driver}\n" for _ in range(gpus)) if driver else \
        "  echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9\n"
    (d / "nvidia-smi").write_text(f'#!/bin/sh\nif [ "$*" = "-L" ]; then\n{listing}  exit 0\nfi\n'
                                  f'if [ "$*" = "--query-gpu=driver_version --format=csv,noheader" ]; then\n{query}'
                                  '  exit 0\nfi\necho "fake nvidia-smi: unexpected $*" >&2; exit 9\n')
    (d / "nvidia-smi").chmod(0o755)
    return d


def check(path_dir, *args: str) -> subprocess.CompletedProcess:
    """scripts/check_cuda.py as setup.sh runs it, with only `path_dir` on PATH (no real nvidia-smi is found)."""
    env = dict(os.environ, PATH=str(path_dir))
    return subprocess.run([sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=60)


def test_constraints_pin_the_torch_of_a_known_cuda_version():
    assert PIN == "2.14.0" and VLLM == "0.33.0"  # the pair vllm 0.33.0's metadata pins (the registry test asks)
    assert check_cuda.PYPI_TORCH_CUDA[PIN] == "13.0"


@pytest.mark.parametrize("driver", ["535.104.05", "549.1"])
def test_a_driver_older_than_550_stops_setup_and_says_what_to_do(tmp_path, driver):
    proc = check(fake_smi(tmp_path, driver))
    assert proc.returncode == 2, proc.stderr
    msg = proc.stderr.strip()
    assert len(msg.splitlines()) == 1
    assert f"NVIDIA driver {driver} is too old for torch==2.14.0 (the torch vllm==0.33.0 requires)" in msg
    assert "CUDA 13.0" in msg and "driver >= 580" in msg and "Upgrade the driver" in msg
    assert 'GRPO_NO_VLLM=1 GRPO_TORCH="torch==2.10.0" bash scripts/setup.sh' in msg  # the CUDA 12 way, named
    assert ">= 550 for the CUDA 12 set with vllm==0.19.1" in msg


@pytest.mark.parametrize("driver", ["550.54.15", "570.133.20", "575.1"])
def test_a_driver_of_550_to_579_gets_the_cuda_12_set_with_vllm(tmp_path, driver):
    """Issue 42: the second pinned set, picked by the driver and named (stdout: what setup.sh reads)."""
    proc = check(fake_smi(tmp_path, driver), "--print-set")
    assert proc.returncode == 0 and proc.stdout == "cuda12\n", proc.stderr
    assert f"NVIDIA driver {driver}: the cuda12 set (constraints-cuda12.txt + requirements-vllm-cuda12.txt): fits " \
           "torch==2.10.0 (the torch vllm==0.19.1 requires), built for CUDA 12.8" in proc.stderr
    assert check(fake_smi(tmp_path, driver), "--print-set", "--torch", "torch==2.14.0").returncode == 2  # CUDA 13
    newest = check(fake_smi(tmp_path, "580.65.06"), "--print-set")
    assert newest.stdout == "cuda\n" and "the cuda set (constraints-cuda.txt" in newest.stderr
    asked = check(fake_smi(tmp_path, "580.65.06"), "--print-set", "--torch", "torch==2.10.0")
    assert asked.returncode == 0 and asked.stdout == "cuda12\n"  # GRPO_TORCH naming the CUDA 12 torch picks its set


def test_the_cuda_12_set_pins_the_torch_its_vllm_requires():
    assert check_cuda.pinned(REPO / "constraints-cuda12.txt", "torch") == "2.10.0" == PIN12
    assert VLLM12 == "0.19.1" and check_cuda.PYPI_TORCH_CUDA[PIN12] == "12.8"


def test_a_driver_too_old_for_cuda_12_as_well_is_told_to_upgrade_only(tmp_path):
    proc = check(fake_smi(tmp_path, "470.256.02"))
    assert proc.returncode == 2 and "driver >= 580" in proc.stderr and "GRPO_NO_VLLM" not in proc.stderr


@pytest.mark.parametrize("driver", ["580.65.06", "590.44.01"])
def test_a_driver_of_580_or_newer_fits(tmp_path, driver):
    proc = check(fake_smi(tmp_path, driver))
    assert proc.returncode == 0, proc.stderr
    assert f"NVIDIA driver {driver}: the cuda set" in proc.stderr and "fits torch==2.14.0" in proc.stderr \
        and "CUDA 13.0" in proc.stderr
    have = metadata.version("torch")  # the venv running the check: a torch of another version gets replaced
    assert (f"torch {have} in this venv is replaced by torch==2.14.0" in proc.stderr) == (have.split("+")[0] != PIN)


def test_no_nvidia_smi_or_an_unreadable_driver_is_said_not_checked(tmp_path):
    none = check(tmp_path)  # an empty PATH directory: no nvidia-smi (GRPO_TORCH set on a machine without a GPU)
    assert none.returncode == 0 and "no nvidia-smi here, so the NVIDIA driver is not checked" in none.stderr
    assert "needs >= 580" in none.stderr
    broken = check(fake_smi(tmp_path, None))
    assert broken.returncode == 0 and "could not be read, so it is not checked" in broken.stderr
    assert "couldn't communicate with the NVIDIA driver" in broken.stderr


@pytest.mark.parametrize("spec,ok", [
    ("torch==2.13.0", False), ("torch == 2.12.1", False),
    ("/w/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),
    ("torch", True), ("torch==2.14.0", True), ("torch==2.14.0+cu130", True), ("torch>=2.10", True),
    ("https://h/whl/torch-2.14.0%2Bcu130-cp311-cp311-manylinux_2_28_x86_64.whl", True)])
def test_grpo_torch_must_be_the_pinned_version(tmp_path, spec, ok):
    proc = check(fake_smi(tmp_path, "580.65.06"), "--torch", spec)
    assert proc.returncode == (0 if ok else 2), proc.stderr
    if not ok:
        assert proc.stderr.strip() == (
            f'[setup] GRPO_TORCH="{spec}" conflicts with torch==2.14.0, the torch vllm==0.33.0 requires '
            '(constraints-cuda.txt): use GRPO_TORCH="torch==2.14.0" (or leave it unset), or GRPO_NO_VLLM=1 to keep '
            'your torch without vLLM')


def run_setup(tmp_path, driver: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/setup.sh itself on a fake CUDA machine: GRPO_VENV is a fresh directory whose bin/python records every
    call and runs no pip (scripts/check_cuda.py it runs for real, standard library only: -S); PYTHON=false, so no
    real venv can be made. Returns the run and the recorded calls."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\necho "$*" >> {log}\ncase "$1" in\n  -m) exit 0 ;;\n  -c) exit 1 ;;\n'
        f'  *) exec {shlex.quote(sys.executable)} -S "$@" ;;\nesac\n')
    (venv / "bin" / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_TORCH", "GRPO_NO_VLLM")}
    env.update(PATH=f"{fake_smi(tmp_path, driver)}:/usr/bin:/bin", GRPO_VENV=str(venv), PYTHON="false", **env_extra)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, [re.sub(r"^-m pip --disable-pip-version-check -q ", "pip ", c) for c in calls]


def test_setup_checks_the_driver_first_then_installs_the_pinned_set(tmp_path):
    proc, calls = run_setup(tmp_path, "580.65.06")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["pip install --upgrade pip setuptools wheel",
                     "scripts/check_cuda.py --print-set",
                     "pip install -c constraints-cuda.txt torch",  # the pinned torch at once: no newest first
                     "pip install -c constraints-cuda.txt -r requirements.txt -r requirements-vllm-cuda.txt",
                     "pip install -c constraints-cuda.txt --no-deps -e ."], proc.stderr
    assert "NVIDIA driver 580.65.06: the cuda set" in proc.stderr and "fits torch==2.14.0" in proc.stderr


def test_setup_on_a_570_driver_installs_the_cuda_12_set_with_vllm(tmp_path):
    proc, calls = run_setup(tmp_path, "570.133.20")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["pip install --upgrade pip setuptools wheel",
                     "scripts/check_cuda.py --print-set",
                     "pip install -c constraints-cuda12.txt torch",
                     f"pip install -c constraints-cuda12.txt -r {tmp_path}/venv/.requirements-cuda12.txt "
                     "-r requirements-vllm-cuda12.txt",
                     "pip install -c constraints-cuda12.txt --no-deps -e ."], proc.stderr
    assert "[setup] CUDA set: cuda12 (constraints-cuda12.txt, requirements-vllm-cuda12.txt)" in proc.stderr
    base = (tmp_path / "venv" / ".requirements-cuda12.txt").read_text()  # vllm 0.19.1's numba pin, not ours
    assert "numba==" not in base and "numpy==" not in base and "transformers==" in base


def test_setup_stops_before_any_torch_download_on_an_old_driver_or_another_torch(tmp_path):
    proc, calls = run_setup(tmp_path / "old", "535.104.05")
    assert proc.returncode == 2 and "NVIDIA driver 535.104.05 is too old" in proc.stderr
    assert calls == ["pip install --upgrade pip setuptools wheel", "scripts/check_cuda.py --print-set"]
    proc, calls = run_setup(tmp_path / "other", "580.65.06", GRPO_TORCH="torch==2.13.0")
    assert proc.returncode == 2 and 'GRPO_TORCH="torch==2.13.0" conflicts with torch==2.14.0' in proc.stderr
    assert calls == ["pip install --upgrade pip setuptools wheel",
                     "scripts/check_cuda.py --print-set --torch torch==2.13.0"]
    proc, calls = run_setup(tmp_path / "pinned", "580.65.06", GRPO_TORCH="torch==2.14.0")
    assert proc.returncode == 0 and "pip install -c constraints-cuda.txt torch==2.14.0" in calls, proc.stderr


def test_setup_without_vllm_keeps_the_users_torch_unpinned(tmp_path):
    proc, calls = run_setup(tmp_path, "535.104.05", GRPO_NO_VLLM="1", GRPO_TORCH="torch==2.10.0")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["pip install --upgrade pip setuptools wheel", "pip install torch==2.10.0",
                     "pip install -r requirements.txt", "pip install --no-deps -e ."]


def pip_report(tmp_path, *args: str) -> dict:
    """`pip install --dry-run --report` of `args` (nothing installed), resolved as if the venv were empty."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), *args], cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, DS_BUILD_OPS="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {it["metadata"]["name"].lower(): it["metadata"] for it in json.loads(report.read_text())["install"]}


def cuda_of(torch_requires: list[str]) -> str:
    """major.minor of the CUDA runtime a torch wheel requires (cuda-toolkit==13.0.3, nvidia-cuda-runtime-cu12==...)."""
    for req in torch_requires:
        m = re.match(r"(?:cuda-toolkit\[[^\]]*\]|nvidia-cuda-runtime-cu\d+)==(\d+\.\d+)", req)
        if m:
            return m.group(1)
    raise AssertionError(f"no CUDA runtime among torch's requirements: {torch_requires}")


@pytest.mark.registry
def test_registry_setup_torch_step_takes_the_pin_at_once(tmp_path):
    got = pip_report(tmp_path, "--no-deps", "-c", "constraints-cuda.txt", "torch")
    assert got["torch"]["version"] == PIN
    assert cuda_of(got["torch"]["requires_dist"]) == check_cuda.PYPI_TORCH_CUDA[PIN]


@pytest.mark.registry
def test_registry_the_cuda_set_resolves_around_the_pinned_torch(tmp_path):
    got = pip_report(tmp_path, "-c", "constraints-cuda.txt", "-r", "requirements.txt", "-r",
                     "requirements-vllm-cuda.txt", "torch")
    assert got["torch"]["version"] == PIN and got["vllm"]["version"] == VLLM
    assert f"torch=={PIN}" in [r.split(";")[0].replace(" ", "") for r in got["vllm"]["requires_dist"]]
    assert cuda_of(got["torch"]["requires_dist"]) == check_cuda.PYPI_TORCH_CUDA[PIN] == "13.0"


@pytest.mark.registry
def test_registry_the_cuda_12_set_resolves_and_its_vllm_has_the_api_the_engine_uses(tmp_path):
    """The CUDA 12 set resolves as the CUDA 13 one does, and vllm 0.19.1's own source (its wheel, `pip download
    --no-deps`) has what trainer/engines/vllm.py calls: LLM.collective_rpc, reset_prefix_cache, apply_model; the
    worker's reload_weights(weights_iterator=...); ModelConfig logprobs_mode with processed_logprobs; CacheConfig
    enable_prefix_caching; generation_config "vllm"; SamplingParams detokenize (docs/install.md lists them)."""
    import zipfile
    own = {re.split(r"\s*==", line)[0].lower() for line in
           (REPO / "constraints-cuda12.txt").read_text().splitlines() if "==" in line and not line.startswith("#")}
    base = tmp_path / "requirements.txt"  # as setup.sh installs it for this set: without the set's own pins
    base.write_text("\n".join(line for line in (REPO / "requirements.txt").read_text().splitlines()
                              if line.split("==")[0].strip().lower() not in own) + "\n")
    got = pip_report(tmp_path, "-c", "constraints-cuda12.txt", "-r", str(base), "-r",
                     "requirements-vllm-cuda12.txt", "torch")
    assert got["torch"]["version"] == PIN12 and got["vllm"]["version"] == VLLM12
    assert f"torch=={PIN12}" in [r.split(";")[0].replace(" ", "") for r in got["vllm"]["requires_dist"]]
    assert cuda_of(got["torch"]["requires_dist"]) == check_cuda.PYPI_TORCH_CUDA[PIN12] == "12.8"
    assert (got["numba"]["version"], got["numpy"]["version"]) == ("0.61.2", "2.2.6")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"vllm=={VLLM12}", "-d",
                           str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = zipfile.ZipFile(next(tmp_path.glob("vllm-*.whl")))
    src = lambda path: wheel.read(path).decode()  # noqa: E731
    llm = src("vllm/entrypoints/llm.py")
    for fn in ("def collective_rpc(", "def reset_prefix_cache(", "def apply_model("):
        assert fn in llm, fn
    assert "def reload_weights(" in src("vllm/v1/worker/gpu_worker.py")
    assert re.search(r"def reload_weights\(\s*self,\s*weights_iterator", src("vllm/v1/worker/gpu_model_runner.py"))
    model = src("vllm/config/model.py")
    assert "logprobs_mode: LogprobsMode" in model and '"processed_logprobs"' in model
    assert 'generation_config: str = "auto"' in model
    assert "enable_prefix_caching: bool" in src("vllm/config/cache.py")
    assert "detokenize: bool" in src("vllm/sampling_params.py")


def test_gpu_check_says_why_torch_sees_no_gpu(tmp_path, monkeypatch):
    import importlib.util
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu_check.py puts bench/ first
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert "torch 2.13.0+cpu is a CPU build" in gpu_check.why_no_cuda("2.13.0+cpu", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "there is no nvidia-smi" in gpu_check.why_no_cuda("2.14.0", "13.0")
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path, "535.104.05")))
    why = gpu_check.why_no_cuda("2.14.0", "13.0")
    assert why.startswith("NVIDIA driver 535.104.05 is too old for torch 2.14.0, built for CUDA 13.0") and "580" in why
    assert gpu_check.nvidia_driver() == "535.104.05"
    assert "fit, yet torch sees no GPU" in gpu_check.why_no_cuda("2.10.0", "12.8")  # 535 runs CUDA 12.8
