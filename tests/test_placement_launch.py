"""launch.sh's side of the placement plan: `launch.sh train|workers --print-plan` with a fake `nvidia-smi` on PATH
(nothing is started), the flags that reach the plan, and the plan in the ref server's /status. The plan itself:
tests/test_placement.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
from conftest import REPO, subprocess_env

from common.config import GRPOConfig
from common.placement.cpu_ranks import auto_cpu_ranks
from common.placement.plan import plan_placement
from common.settings.knobs import load_config


# ------------------------------------------------------------------------------------- launch.sh's side
def gen(q: int, frac: float = 0.9, eager: str = "false") -> str:
    """A worker's generation flags as resolved for its device (common/settings/gen_defaults.py)."""
    return (f" --vllm_eager {eager} --vllm_enable_prefix_caching true --Q_batch_size {q} "
            f"--vllm_gpu_memory_utilization {frac:g}")


def fake_smi(tmp_path, n: int):
    d = tmp_path / f"bin{n}"
    d.mkdir(exist_ok=True)
    lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})"\n' for i in range(n))
    (d / "nvidia-smi").write_text(f'#!/bin/sh\n[ "$1" = "-L" ] || exit 9\n{lines}')
    (d / "nvidia-smi").chmod(0o755)
    return d


def plan_of(tmp_path, n: int, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # GRPO_PYTHON: launch.sh uses this interpreter as it is; without it, a setup stamp gone stale (a changed
    # requirements file) would make scripts/setup.sh see the fake GPU and install CUDA torch into the venv
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{fake_smi(tmp_path, n)}:{os.environ['PATH']}",
                         GRPO_PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(env_extra or {})
    return subprocess.run(["bash", str(REPO / "launch.sh"), "train", "--print-plan", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_launch_prints_the_plan_and_hands_it_to_each_process(tmp_path):
    proc = plan_of(tmp_path, 4, "--workers", "1", "--", "--model", "tiny", "--gen_backend", "vllm")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ref_server: CUDA_VISIBLE_DEVICES=3 --device cuda:0",
                                        "worker0: CUDA_VISIBLE_DEVICES=2 --device cuda:0" + gen(6),
                                        "trainer: deepspeed --include localhost:0,1"]
    assert "placement: 4 GPU(s) [0, 1, 2, 3], each process on its own GPU" in proc.stderr
    assert not list(tmp_path.glob("runs")) and not (REPO / "runs" / "placement.json").exists()  # nothing started


def test_launch_with_one_gpu_shares_it_and_sets_vllms_fraction(tmp_path):
    proc = plan_of(tmp_path, 1, "--workers", "1", "--", "--gen_backend", "vllm")
    assert proc.returncode == 0, proc.stderr
    assert "worker0: CUDA_VISIBLE_DEVICES=0 --device cuda:0" + gen(3, 0.3) in proc.stdout
    assert "trainer: deepspeed --include localhost:0" in proc.stdout and "only 1 GPU" in proc.stderr


def test_launch_flags_reach_the_plan(tmp_path):
    proc = plan_of(tmp_path, 8, "--workers", "2", "--worker-gpus", "6,7", "--rank-gpus", "0,1,2,3",
                   "--ref-device", "cuda:4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ref_server: CUDA_VISIBLE_DEVICES=4 --device cuda:0",
                                        "worker0: CUDA_VISIBLE_DEVICES=6 --device cuda:0" + gen(6),
                                        "worker1: CUDA_VISIBLE_DEVICES=7 --device cuda:0" + gen(6),
                                        "trainer: deepspeed --include localhost:0,1,2,3"]
    too_many = plan_of(tmp_path, 2, "--workers", "1")
    assert too_many.returncode == 2 and "--share-gpu" in too_many.stderr and not too_many.stdout
    visible = plan_of(tmp_path, 8, "--workers", "1", env_extra={"CUDA_VISIBLE_DEVICES": "2,5,6"})
    assert visible.returncode == 0, visible.stderr
    assert "trainer: deepspeed --include localhost:2" in visible.stdout and "CUDA_VISIBLE_DEVICES=6" in visible.stdout
    cpu = plan_of(tmp_path, 0, "--workers", "1")
    ranks, _, why = auto_cpu_ranks(load_config(GRPOConfig, []))  # no --gpus on CPU: 1 or 2 as measured, said
    assert f"trainer: deepspeed --num_gpus {ranks}" in cpu.stdout and "placement: CPU" in cpu.stderr
    assert f"note: {why}" in cpu.stderr, cpu.stderr


def test_launch_help_documents_the_plan():
    out = subprocess.run(["bash", str(REPO / "launch.sh"), "--help"], capture_output=True, text=True).stdout
    for flag in ("--print-plan", "--share-gpu", "--worker-gpus", "--rank-gpus"):
        assert flag in out


def test_ref_server_status_shows_the_plan(start_server, tiny_model_dir, tmp_path):
    plan = dict(plan_placement(range(4), workers=1).to_json(), found_by="test")
    (tmp_path / "placement.json").write_text(json.dumps(plan))
    with start_server(tiny_model_dir, "--placement-file", str(tmp_path / "placement.json")) as srv:
        status = requests.get(srv.url + "/status", timeout=10).json()
        assert status["placement"] == plan
        page = requests.get(srv.url + "/", timeout=10).text
        assert "ref_server  GPU 3" in page and "deepspeed --include localhost:0,1" in page



def test_ref_server_refuses_a_missing_placement_file(tmp_path):
    from ref_server.config import ServerConfig
    with pytest.raises(ValueError, match="placement_file .* not found"):
        ServerConfig(model="tiny", placement_file=str(tmp_path / "nope.json")).validate()


def test_cuda_visible_devices_without_cuda_finds_no_gpu(monkeypatch):
    """A CUDA_VISIBLE_DEVICES left in the environment names no GPU that this torch can reach (it once made a CPU
    machine plan '1 GPU found' and refuse to start)."""
    import shutil

    import torch

    from common.placement.launch_plan import detect_gpus
    if shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus, how, _ = detect_gpus()
    assert gpus == [] and "CUDA_VISIBLE_DEVICES=1" in how


def workers_plan_of(tmp_path, n: int, *args: str) -> subprocess.CompletedProcess:
    # GRPO_PYTHON: launch.sh uses this interpreter as it is; without it, a setup stamp gone stale (a changed
    # requirements file) would make scripts/setup.sh see the fake GPU and install CUDA torch into the venv
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{fake_smi(tmp_path, n)}:{os.environ['PATH']}",
                         GRPO_PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["bash", str(REPO / "launch.sh"), "workers", "--print-plan", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("n,args,want", [
    (4, ["--workers", "4"], ["worker0: CUDA_VISIBLE_DEVICES=3 --device cuda:0" + gen(3),
                             "worker1: CUDA_VISIBLE_DEVICES=2 --device cuda:0" + gen(3),
                             "worker2: CUDA_VISIBLE_DEVICES=1 --device cuda:0" + gen(3),
                             "worker3: CUDA_VISIBLE_DEVICES=0 --device cuda:0" + gen(3)]),
    (8, ["--workers", "2", "--first-id", "3", "--", "--gen_backend", "vllm", "--vllm_tensor_parallel_size", "4"],
     ["worker3: CUDA_VISIBLE_DEVICES=4,5,6,7 --device cuda:0" + gen(3),
      "worker4: CUDA_VISIBLE_DEVICES=0,1,2,3 --device cuda:0" + gen(3)]),
    (8, ["--workers", "2", "--worker-gpus", "2,5"], ["worker0: CUDA_VISIBLE_DEVICES=2 --device cuda:0" + gen(3),
                                                     "worker1: CUDA_VISIBLE_DEVICES=5 --device cuda:0" + gen(3)]),
    (4, ["--workers", "2", "--share-gpu", "--worker-gpus", "1,1", "--", "--gen_backend", "vllm"],
     ["worker0: CUDA_VISIBLE_DEVICES=1 --device cuda:0" + gen(3, 0.15),
      "worker1: CUDA_VISIBLE_DEVICES=1 --device cuda:0" + gen(3, 0.15) + " --start_after worker0"]),
])
def test_launch_workers_prints_each_workers_own_gpus(tmp_path, n, args, want):
    """`./launch.sh workers --print-plan` on a worker host with 4 or 8 GPUs: one line per worker, in the format of
    `launch.sh train --print-plan` (before: no plan, every worker on GPU 0)."""
    proc = workers_plan_of(tmp_path, n, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == want
    assert f"placement: {n} GPU(s)" in proc.stderr and "[launch] worker" not in proc.stderr  # nothing started
    assert not list(tmp_path.glob("**/placement.json"))


def test_launch_workers_refuses_a_plan_that_does_not_fit(tmp_path):
    proc = workers_plan_of(tmp_path, 4, "--workers", "5")
    assert proc.returncode == 2 and not proc.stdout
    assert "needs 5 GPUs" in proc.stderr and "--share-gpu" in proc.stderr
    proc = workers_plan_of(tmp_path, 4, "--workers", "1", "--worker-gpus", "7")
    assert proc.returncode == 2 and "GPU(s) [7]" in proc.stderr


def test_launch_train_gives_a_tensor_parallel_worker_its_gpus(tmp_path):
    proc = plan_of(tmp_path, 8, "--workers", "2", "--", "--gen_backend", "vllm", "--vllm_tensor_parallel_size", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ref_server: CUDA_VISIBLE_DEVICES=7 --device cuda:0",
                                        "worker0: CUDA_VISIBLE_DEVICES=5,6 --device cuda:0" + gen(6),
                                        "worker1: CUDA_VISIBLE_DEVICES=3,4 --device cuda:0" + gen(6),
                                        "trainer: deepspeed --include localhost:0,1,2"]
    one = plan_of(tmp_path, 1, "--workers", "1", "--", "--gen_backend", "vllm")
    assert "worker0: CUDA_VISIBLE_DEVICES=0 --device cuda:0" + gen(3, 0.3) + " --wait_for_ranks 1" \
        in one.stdout.splitlines()


def test_print_plan_gives_each_gpu_worker_cuda_graphs_and_prefix_caching(tmp_path):
    """Issue 42: on 4 (fake) H100s every worker is started with CUDA graphs (vllm_eager false) and prefix caching,
    a step's prompts per call, 0.9 of its own GPU; on CPU eager; what the user sets is kept."""
    proc = plan_of(tmp_path, 4, "--workers", "2", "--", "--gen_backend", "vllm", "--train_batch_groups", "32")
    assert proc.returncode == 0, proc.stderr
    workers = [line for line in proc.stdout.splitlines() if line.startswith("worker")]
    assert len(workers) == 2 and all(line.endswith(gen(32)) for line in workers), workers  # 256 seqs / 8
    assert "vllm_eager false vllm_enable_prefix_caching true Q_batch_size 32" in proc.stderr
    own = plan_of(tmp_path, 4, "--workers", "1", "--", "--gen_backend", "vllm", "--vllm_eager", "true",
                  "--vllm_enable_prefix_caching", "false", "--Q_batch_size", "5",
                  "--vllm_gpu_memory_utilization", "0.7")
    assert own.returncode == 0, own.stderr
    assert "--vllm_eager true --vllm_enable_prefix_caching false --Q_batch_size 5 --vllm_gpu_memory_utilization " \
           "0.7" in own.stdout
    cpu = plan_of(tmp_path, 0, "--workers", "1", "--", "--gen_backend", "vllm")
    assert "worker0: (environment unchanged) " + gen(2, eager="true").strip() in cpu.stdout.splitlines()


# ------------------------------------------------------------------------------------- torch's GPU build, unimported
@pytest.mark.parametrize("text, want", [
    ("from typing import Optional\n__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
     False),
    ("__version__ = '2.13.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", True),
    ("__version__ = '2.13.0+rocm6.4'\ncuda = None\nhip = '6.4.1'\n", True),
    ("__version__ = '2.13.0'\n", None),  # says nothing: only torch knows
    ("cuda = (\n", None),
])
def test_the_gpu_build_is_read_from_torchs_version_file(tmp_path, monkeypatch, text, want):
    """launch.sh's first question (no GPU: DeepSpeed on CPU) and the plan's GPU count without nvidia-smi cost an
    `import torch` each (~1.5 CPU-s); a CPU build answers from torch/version.py, anything else still asks torch."""
    from common.placement import cuda
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (pkg / "version.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # find_spec: sys.path, not the torch running here
    assert cuda.gpu_build() is want
    if want is False:
        assert not cuda.available() and cuda.device_count() == 0  # (torch's __init__ above raises when imported)
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch at all: no GPU, as the old `import torch` check said
    assert cuda.gpu_build() is False and not cuda.available()


def test_a_cpu_plan_imports_no_torch(tmp_path):
    """`launch.sh train --print-plan` / `check` on a CPU machine: the placement CLI reads the config and plans without
    torch (it cost ~1.5 CPU-s of each launch.sh call). Where torch is a GPU build it is asked, as before."""
    from common.placement.cuda import gpu_build
    if gpu_build() is not False:
        pytest.skip("torch here is a CUDA/ROCm build: the plan asks torch")
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{tmp_path}:/usr/bin:/bin")  # no nvidia-smi
    code = ("import sys; from common.placement.launch_plan import main; "
            "rc = main(['--workers', '1', '--', '--model', 'tiny'])"
            "; assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ranks = auto_cpu_ranks(load_config(GRPOConfig, ["--model", "tiny"]))[0]
    assert f"PLAN_DS=(--num_gpus {ranks})" in proc.stdout and "PLAN_REF_MODEL=tiny" in proc.stdout
