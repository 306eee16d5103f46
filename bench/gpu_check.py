"""The GPU check: on one GPU, `launch.sh train` with 1 NCCL rank + the ref server + one HF genonly worker (the
placement plan shares the GPU), for ZeRO-2 bf16, ZeRO-3 (whole batch, micro-batches of 3) and LoRA, 10 steps each,
on the embedded tiny model and on a random-weight Qwen2.5-0.5B-shaped model built here from a config (real Qwen2.5
vocabulary, tests/qwen_vocab.py; nothing downloaded). Prints per run: s/step, peak GPU memory (nvidia-smi, all
processes on the GPU, and the rank's torch.cuda.max_memory_allocated) and the worker's generated tokens/s.
Last line: one JSON object.

On a bare GPU machine (torch, transformers, peft, accelerate; no internet), after bench/gpu_check_wheels.py gather
here and copying the checkout with .whl/ there, ONE command (`bench/gpu_check_wheels.py command` prints it):

    python3 -m pip install --no-index --no-deps --target .whl/site .whl/*.whl && env PYTHONPATH=$PWD/.whl/site:$PWD \\
      PATH=$PWD/.whl/site/bin:$PATH GRPO_PYTHON=python3 TOKENIZERS_PARALLELISM=false python3 bench/gpu_check.py

The same plumbing on CPU, reduced (gloo rank, RSS instead of GPU memory):

    .venv/bin/python bench/gpu_check.py --device cpu --steps 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # check_cuda: the driver table scripts/setup.sh checks against
VARIANTS = {  # trainer flags of each run (the rank trains bf16 weights in all of them)
    "zero2_bf16": ["--zero_stage", "2", "--bf16", "true"],
    "zero3": ["--zero_stage", "3", "--bf16", "true"],
    # micro-batches under ZeRO-3 (issue 30: its update came from the last micro-batch alone before the fix)
    "zero3_micro": ["--zero_stage", "3", "--bf16", "true", "--micro_batch_size", "3"],
    "lora": ["--zero_stage", "2", "--bf16", "true", "--lora_r", "16", "--lora_alpha", "32"],
}
QWEN05B = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, dtype="bfloat16")
GEN_RE = re.compile(r"generated (\d+) tokens in ([\d.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(name: str, work: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))  # the real-vocabulary builder lives with the tests
    if name == "tiny":
        from common.tiny_model import ensure_tiny_model
        return Path(ensure_tiny_model())
    if name == "qwen05b":
        from qwen_vocab import cached_checkpoint
        return cached_checkpoint(work / "models", "instruct", **QWEN05B)
    raise SystemExit(f"unknown model {name!r}: tiny or qwen05b")


def launch_cmd(model: Path, variant: str, run: Path, steps: int, max_new_tokens: int) -> list[str]:
    """`launch.sh train` for one run: 1 worker, 1 rank, the built-in arith data and a reward every group spreads."""
    return ["bash", str(REPO / "launch.sh"), "train", "--run-dir", str(run), "--workers", "1", "--gpus", "1",
            "--port", str(free_port()), "--", "--model", str(model), "--data", "arith", "--system_prompt", "",
            "--reward_fns", "toy_rewards:digit_fraction", "--train_zero_spread", "true", "--num_pre_Q", "8",
            "--max_new_tokens", str(max_new_tokens), "--all_steps", str(steps), "--save_steps", str(steps),
            "--get_wait", "60", *VARIANTS[variant]]


class PeakMemory:
    """Samples, every 0.5 s while a run goes, the GPU's used memory (nvidia-smi: every process on it) or, on
    CPU, the summed RSS of the run's processes."""

    def __init__(self, device: str, root_pid: int):
        self.device, self.root_pid, self.peak_mib, self._stop = device, root_pid, 0.0, threading.Event()
        self.smi = shutil.which("nvidia-smi")  # absent: the GPU-wide peak is unknown (None), the rank's still shows
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> float:
        if self.device == "cuda":
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            return max(float(v) for v in out) if out else 0.0
        import psutil
        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, self._sample())
            self._stop.wait(0.5)

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda" and not self.smi:
            self.peak_mib = None
            return self
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()


def summarise(run: Path, rc: int, wall: float, peak_mib: float | None, device: str) -> dict:
    """The figures of one run from its metrics.jsonl and its worker's log."""
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()] \
        if (run / "metrics.jsonl").is_file() else []
    step_s = [r["step_s"] for r in rows if "step_s" in r]
    worker_log = (run / "worker0.log").read_text(errors="replace") if (run / "worker0.log").is_file() else ""
    gen = GEN_RE.findall(worker_log)
    tokens, seconds = (int(gen[-1][0]), float(gen[-1][1])) if gen else (0, 0.0)
    later = step_s[1:] or step_s  # the first step includes warm-up (allocator, kernels, first weight sync)
    return {
        "rc": rc, "steps_done": len(rows), "wall_s": round(wall, 1),
        "s_per_step": round(sum(later) / len(later), 3) if later else None,
        "first_step_s": round(step_s[0], 3) if step_s else None,
        ("peak_gpu_mib" if device == "cuda" else "peak_rss_mib"): None if peak_mib is None else round(peak_mib, 1),
        "rank_peak_mem_mb": round(max((r.get("peak_mem_mb", 0.0) for r in rows), default=0.0), 1),
        "gen_tokens_per_s": round(tokens / seconds, 1) if seconds else None, "gen_tokens": tokens,
    }


def run_one(model: Path, variant: str, work: Path, a) -> dict:
    run = work / "runs" / f"{model.name}-{variant}"
    shutil.rmtree(run, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(REPO),
                                                       str(REPO / "tests")]).strip(os.pathsep))
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU plan, even on a GPU machine
    cmd = launch_cmd(model, variant, run, a.steps, a.max_new_tokens)
    print(f"[gpu_check] {model.name} {variant}: {' '.join(cmd)}", file=sys.stderr)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with PeakMemory(a.device, proc.pid) as mem:
        try:
            _, err = proc.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # launch.sh stops everything it started on TERM
            _, err = proc.communicate()
    res = {"model": model.name, "variant": variant, **summarise(run, proc.returncode, time.time() - t0,
                                                                 mem.peak_mib, a.device), "run_dir": str(run)}
    if proc.returncode != 0:
        res["error_tail"] = err[-1500:]
    return res


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=None, help="comma list of tiny, qwen05b (default: both on cuda, tiny on cpu)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--work", default=None, help="models and run directories (default: a temporary directory)")
    a = ap.parse_args()
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"no CUDA here: {why_no_cuda(torch.__version__, torch.version.cuda)}; "
                             "run with --device cpu for the reduced CPU form")
        device_name = torch.cuda.get_device_name(0)
        stack = {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": nvidia_driver()}
    else:
        device_name, stack = "cpu", {}
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu_check-"))
    models = (a.models or ("tiny,qwen05b" if a.device == "cuda" else "tiny")).split(",")
    runs = []
    for name in models:
        path = model_dir(name, work)
        for variant in a.variants.split(","):
            r = run_one(path, variant, work, a)
            r["model"] = name
            runs.append(r)
            mem = r.get("peak_gpu_mib", r.get("peak_rss_mib"))
            print(f"[gpu_check] {name:8s} {variant:10s} rc {r['rc']} steps {r['steps_done']}/{a.steps}  "
                  f"{r['s_per_step']} s/step  peak {mem} MiB (rank {r['rank_peak_mem_mb']} MB)  "
                  f"gen {r['gen_tokens_per_s']} tokens/s", file=sys.stderr)
    ok = all(r["rc"] == 0 and r["steps_done"] == a.steps for r in runs)
    print(json.dumps({"device": device_name, **stack, "steps": a.steps, "ok": ok, "work": str(work), "runs": runs}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
