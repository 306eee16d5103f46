"""bench/gpu_check.py's `launch.sh train` runs: the variants' flags, one run under a time limit with every process's
peak memory sampled, its figures from metrics.jsonl, the worker's log and launch.sh's memory estimate; and the
stack's versions."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # common/ on a bare GPU machine (GRPO_PYTHON, no editable install)
from common.listen import free_port  # noqa: E402

VARIANTS = {  # trainer flags of each run; the rank trains bf16 weights in all of them
    "zero2_vllm": ["--zero_stage", "2", "--bf16", "true"],  # + --gen_backend vllm where vLLM imports
    "zero3_micro_packed": ["--zero_stage", "3", "--bf16", "true", "--micro_batch_size", "3", "--padding_free", "true"],
    "lora": ["--zero_stage", "2", "--bf16", "true", "--lora_r", "16", "--lora_alpha", "32"],
}
STOP_GRACE_S = 20.0  # a cut run's launch.sh gets this long to stop what it started (TERM), then KILL
GEN_RE = re.compile(r"generated (\d+) tokens in ([\d.]+) s")
EST_RE = re.compile(r"^\[launch\]\s{2,}(ref_server|worker\d+|ranks)\s+(.*)$", re.M)
GIB_RE = re.compile(r"= ([\d.]+) GiB")
# cmdline marker -> process (first match; the rank's command names --ref_server, the launcher's trainer/main.py)
ROLES = (("genonly", "worker0"), ("-m ref_server", "ref_server"), ("deepspeed.launcher", None), ("bin/deepspeed", None),
         ("trainer/main.py", "rank0"))


def launch_cmd(model: Path, variant: str, run: Path, steps: int, max_new_tokens: int, vllm: bool,
               checkpoint: bool, skip_checks: bool = False) -> list[str]:
    """`launch.sh train`: 1 worker, 1 rank, the built-in arith data, a reward every group spreads; every batch from
    the worker (get_wait 0: the rank waits for it, so the wait share is the generation's cost). skip_checks (--smoke
    only): launch.sh --skip-checks, as the other benches' smoke runs (the checks are not what this measures)."""
    gen = ["--gen_backend", "vllm"] if vllm and variant == "zero2_vllm" else []
    save = ["--save_steps", str(steps)] if checkpoint else ["--save_strategy", "no"]
    return ["bash", str(REPO / "launch.sh"), "train", *(["--skip-checks"] if skip_checks else []), "--run-dir",
            str(run), "--workers", "1", "--gpus", "1",
            "--port", str(free_port()), "--", "--model", str(model), "--data", "arith", "--system_prompt", "",
            "--reward_fns", "toy_rewards:digit_fraction", "--train_zero_spread", "true", "--num_pre_Q", "8",
            "--max_new_tokens", str(max_new_tokens), "--all_steps", str(steps), "--get_wait", "0",
            "--sync_steps", "1", "--seed", "1", *save, *gen, *VARIANTS[variant]]


def role_of(proc) -> str | None:
    """Which of the run's processes `proc` belongs to (a vLLM engine core counts as its worker)."""
    import psutil
    while proc is not None:
        try:
            cmd = " ".join(proc.cmdline())
            for marker, role in ROLES:
                if marker in cmd:
                    return role  # None: DeepSpeed's launchers, not counted
            proc = proc.parent()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
    return None


class PeakMemory:
    """Every 0.5 s while a run goes: each process's GPU memory (nvidia-smi --query-compute-apps: what the process
    holds on the GPU, its allocator's reserve and CUDA context included) or, on CPU, its RSS, summed per role."""

    def __init__(self, device: str, root_pid: int):
        self.device, self.root_pid, self.peak, self._stop = device, root_pid, {}, threading.Event()
        self.smi = shutil.which("nvidia-smi")
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> dict[str, float]:
        import psutil
        per: dict[str, float] = {}
        if self.device == "cuda":
            out = subprocess.run([self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout
            pairs = [(int(p), float(m)) for p, m in (ln.split(",") for ln in out.splitlines() if "," in ln)
                     if p.strip().isdigit() and m.strip().replace(".", "").isdigit()]
        else:
            try:
                kids = psutil.Process(self.root_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return per
            pairs = []
            for p in kids:
                try:
                    pairs.append((p.pid, p.memory_info().rss / 2**20))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        for pid, mib in pairs:
            try:
                role = role_of(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
            if role:
                per[role] = per.get(role, 0.0) + mib
        return per

    def _loop(self) -> None:
        while not self._stop.is_set():
            for role, mib in self._sample().items():
                self.peak[role] = max(self.peak.get(role, 0.0), mib)
            self._stop.wait(0.5)

    def __enter__(self) -> PeakMemory:
        if self.device == "cpu" or self.smi:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()


def estimate(launch_err: str, model: Path, cmd: list[str], device: str) -> dict:
    """launch.sh's memory estimate per process (GiB) and its lines. On CPU launch.sh prints none (no GPU): the
    same function (common/placement/memory_report.py) is asked for a one-GPU plan of the same flags, said so."""
    lines: list[str] = []
    for ln in launch_err.splitlines():  # the estimate's header, then its indented lines (the plan's come before)
        if ln.startswith("[launch] memory estimate") or (lines and ln.startswith("[launch]  ")):
            lines.append(ln)
        elif lines:
            break
    source = "printed by launch.sh"
    if not lines:
        from common.config import GRPOConfig
        from common.placement.launch_plan import plan_for
        from common.placement.memory_report import memory_report
        from common.settings.knobs import load_config
        cfg = load_config(GRPOConfig, cmd[cmd.index("--") + 1:], prog="trainer/main.py")
        if not Path(cfg.ds_config).is_absolute():  # launch.sh runs from the checkout; this may not
            cfg.ds_config = str(REPO / cfg.ds_config)
        rep = memory_report(cfg, plan_for(cfg, [0], workers=1, ranks=1))
        lines = [f"[launch] {ln}" for ln in rep.lines]
        source = ("launch.sh prints none without a GPU: common/placement/memory_report.py for a 1-GPU plan of the "
                  "same flags (GPU size unknown: no verdict)" if device == "cpu" else "not printed (see error)")
    per = {}
    for m in EST_RE.finditer("\n".join(lines)):
        g = GIB_RE.search(m.group(2))
        per["rank0" if m.group(1) == "ranks" else m.group(1)] = float(g.group(1)) if g else None
    return {"estimate_gib": per, "estimate_lines": [ln.removeprefix("[launch] ") for ln in lines],
            "estimate_source": source}


def figures(run: Path, steps: int) -> dict:
    """The run's figures from metrics.jsonl (the first step left out of the means: warm-up) and its worker's log."""
    path = run / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    rows = [r for r in rows if "step_s" in r]
    later = rows[1:] or rows
    mean = lambda k: round(sum(r[k] for r in later) / len(later), 4) if later and all(k in r for r in later) else None  # noqa: E731,E501
    step_s, wait_s = mean("step_s"), mean("wait_s")
    log = (run / "worker0.log").read_text(errors="replace") if (run / "worker0.log").is_file() else ""
    gen = GEN_RE.findall(log)
    tokens, seconds = (int(gen[-1][0]), float(gen[-1][1])) if gen else (0, 0.0)
    return {
        "steps_done": len(rows), "steps": steps, "s_per_step": step_s,
        "first_step_s": rows[0]["step_s"] if rows else None,
        "wait_s": wait_s, "wait_share": round(wait_s / step_s, 4) if step_s and wait_s is not None else None,
        "train_tokens_per_s": mean("tokens_per_s"), "sync_s": mean("sync_s"), "padding_share": mean("padding_share"),
        "logp_mismatch_mean": mean("logp_mismatch_mean"),
        "logp_mismatch_max": max((r["logp_mismatch_max"] for r in rows if "logp_mismatch_max" in r), default=None),
        "gen_tokens_per_s": round(tokens / seconds, 1) if seconds else None, "gen_tokens": tokens,
        "rank0_max_memory_allocated_mib": max((r.get("peak_mem_mb", 0.0) for r in rows), default=None),
        "rank0_max_memory_reserved_mib": max((r.get("peak_reserved_mb", 0.0) for r in rows), default=None) or None,
        "engine": "vllm" if "generation engine: vllm" in log else "hf" if "generation engine: hf" in log else None,
    }


def run_variant(name: str, model: Path, work: Path, device: str, steps: int, max_new_tokens: int, limit: float,
                env: dict, vllm: bool, checkpoint: bool, skip_checks: bool = False) -> dict:
    """One `launch.sh train` run, cut (launch.sh stops everything it started on TERM) when `limit` s pass."""
    run = work / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    cmd = launch_cmd(model, name, run, steps, max_new_tokens, vllm, checkpoint, skip_checks)
    res = {"variant": name, "gen_backend": "vllm" if "--gen_backend" in cmd else "hf", "checkpoint": checkpoint,
           "run_dir": str(run), "command": " ".join(cmd[1:])}
    if name == "zero2_vllm" and not vllm:
        res["gen_backend_note"] = "vLLM does not import here: this run used an HF worker"
    if limit <= 10:
        return {**res, "ok": False, "cut": True, "error": f"not started: {max(limit, 0):.0f} s left of the deadline"}
    print(f"[gpu_check] {name}: {res['command']} (limit {limit:.0f} s)", file=sys.stderr, flush=True)
    t0, cut = time.time(), False
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    with PeakMemory(device, proc.pid) as mem:
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            cut = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    reader.join(timeout=10)
    text = "".join(err)
    res.update(figures(run, steps), rc=proc.returncode, cut=cut, wall_s=round(time.time() - t0, 1))
    res.update(estimate(text, model, cmd, device))
    res["measured_peak_mib"] = {k: round(v, 1) for k, v in mem.peak.items()}
    res["measured_by"] = ("nvidia-smi --query-compute-apps (all the process holds on the GPU)" if device == "cuda"
                          else "RSS of each process (and its children), sampled every 0.5 s")
    res["checkpoint_dirs"] = sorted(p.name for p in run.glob("*") if p.is_dir() and (
        p.name == "final" or p.name == "ds" or p.name.startswith("step_")))
    res["ok"] = proc.returncode == 0 and not cut and res["steps_done"] == steps
    res["figures_complete"] = res["steps_done"] == steps  # a run cut while it shut down still measured every step
    if cut:
        res["error"] = f"cut at the deadline after {res['wall_s']} s ({res['steps_done']}/{steps} steps logged)"
    elif proc.returncode != 0:
        res["error"] = text[-1500:]
    return res


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def stack_versions(device: str) -> dict:
    """Versions of the stack (vLLM's: vllm_imported)."""
    import torch
    out = {"device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "driver": None, "nccl": None,
           **{k: _version(d) for k, d in (("transformers", "transformers"), ("deepspeed", "deepspeed"),
                                          ("peft", "peft"), ("flash_attn", "flash-attn"))}}
    if device == "cuda":
        if not torch.cuda.is_available():
            from gpu_check_lib.cuda_why import why_no_cuda
            raise SystemExit(f"no CUDA here: {why_no_cuda(torch.__version__, torch.version.cuda)}; "
                             "run with --device cpu for the same runs at the tiny size")
        from gpu_check_lib.cuda_why import nvidia_driver
        out.update(device=torch.cuda.get_device_name(0), driver=nvidia_driver(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def start_vllm_import(env: dict) -> subprocess.Popen:
    """Does vLLM import here? Asked in a child, alongside the probes (an import that fails or hangs stays there)."""
    return subprocess.Popen([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def vllm_imported(proc: subprocess.Popen, timeout: float = 180.0) -> dict:
    """{"vllm": version} or {"vllm": None, "vllm_import_error": why}."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"vllm": None, "vllm_import_error": f"import vllm took over {timeout:.0f} s"}
    if proc.returncode == 0 and out.strip():
        return {"vllm": out.strip().splitlines()[-1]}
    return {"vllm": None, "vllm_import_error": (err.strip().splitlines() or ["no output"])[-1][:300]}
