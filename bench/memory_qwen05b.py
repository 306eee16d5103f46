"""Peak memory of every process of a `launch.sh train` run on a Qwen2.5-0.5B-shaped model (issue 11, item 8).

Builds a random-weight Qwen2 body (default: Qwen2.5-0.5B's shape: 24 layers, hidden 896, intermediate 4864,
14 heads, 2 kv heads, vocab 151,936, tied embeddings, bfloat16 on disk) with the real Qwen2.5 tokenizer
(tests/qwen_vocab.py), runs `launch.sh train` for --steps steps with 2 ranks + 1 genonly worker + the ref
server, samples each process's RSS (psutil, every --every s) and reports the peaks, the peak of the sum,
seconds per step and the run directory's disk use. Last line: one JSON object.

    .venv/bin/python bench/memory_qwen05b.py                       # the real shape (~20 GiB: a 24 GiB box)
    .venv/bin/python bench/memory_qwen05b.py --bf16 false --gradient-checkpointing false  # fp32 ranks
    .venv/bin/python bench/memory_qwen05b.py --layers 2 --hidden 128 --intermediate 256 --heads 4  # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common.listen import free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the real-vocabulary builder lives with the tests


def role(p: psutil.Process) -> str | None:
    """Which part of the run a process is (None: not one we report, e.g. bash or tee)."""
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "-m ref_server" in cmd:
        return "ref_server"
    if "trainer/main.py genonly" in cmd:
        return "worker" + cmd.split("--worker_id", 1)[1].split()[0] if "--worker_id" in cmd else "worker"
    if "trainer/main.py" in cmd and "--local_rank=" in cmd:
        return "rank" + cmd.split("--local_rank=", 1)[1].split()[0]
    if "deepspeed" in cmd and "launch" in cmd:
        return "ds_launcher"
    return None


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the checkpoint on disk (Qwen ships bfloat16)")
    ap.add_argument("--ref-dtype", default="bfloat16", help="launch.sh --ref-dtype")
    ap.add_argument("--worker-dtype", default="bfloat16", help="launch.sh --worker-dtype")
    ap.add_argument("--bf16", default="true", choices=["true", "false"],
                    help="trainer --bf16: the ranks' weights in bf16 under DeepSpeed (default true, which CPU "
                         "ranks need to fit; false = float32 weights)")
    ap.add_argument("--gradient-checkpointing", default="true", choices=["true", "false"],
                    help="trainer --gradient_checkpointing (default true)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-pre-q", type=int, default=4)
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "gsm8k"),
                    help="GSM8K directory ({train,test}.jsonl; default: ../shared/data/gsm8k beside the checkout)")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "qwen_vocab"), help="where the model is built")
    ap.add_argument("--run-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--every", type=float, default=0.5, help="RSS sampling period (s)")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's short run: a 2-layer, hidden-128 body (real vocabulary), 1 step of 2 "
                         "prompts x 8 new tokens on the demo's arith data, launch.sh train --skip-checks --gpus 1; its "
                         "temporary run directory is removed")
    ap.add_argument("trainer_args", nargs="*", help="extra trainer flags after --")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads = 2, 128, 256, 4, 2
        a.steps, a.max_new_tokens, a.num_pre_q, a.data = 1, 8, 2, "arith"

    from qwen_vocab import cached_checkpoint

    t0 = time.time()
    model = cached_checkpoint(a.cache, "instruct", layers=a.layers, hidden=a.hidden, intermediate=a.intermediate,
                              heads=a.heads, kv_heads=a.kv_heads, dtype=a.dtype)
    build_s = time.time() - t0
    scratch = None if a.run_dir else tempfile.mkdtemp(prefix="mem05b-")
    run = Path(a.run_dir or scratch) / "run"
    # --smoke: one rank and no launch.sh checks (neither is what is measured; a smoke run is mostly start-up)
    cmd = ["bash", str(REPO / "launch.sh"), "train", *(["--skip-checks"] if a.smoke else []), "--run-dir", str(run),
           "--workers", "1", "--gpus", "1" if a.smoke else "2",
           "--port", str(free_port()), "--ref-dtype", a.ref_dtype, "--worker-dtype", a.worker_dtype, "--",
           "--model", str(model), "--data", a.data, "--reward_fns", "toy_rewards:digit_fraction",
           "--train_zero_spread", "true", "--max_new_tokens", str(a.max_new_tokens), "--num_pre_Q",
           str(a.num_pre_q), "--all_steps", str(a.steps), "--save_steps", str(a.steps), "--get_wait", "30",
           "--data_limit", "64", "--bf16", a.bf16, "--gradient_checkpointing", a.gradient_checkpointing,
           *a.trainer_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    print("running:", " ".join(cmd), file=sys.stderr)
    peaks: dict[str, int] = {}
    peak_total = 0
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in procs:
            name = role(p)
            if name is None:
                continue
            try:
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            peaks[name] = max(peaks.get(name, 0), rss)
            total += rss
        peak_total = max(peak_total, total)
        time.sleep(a.every)
    err = proc.stderr.read() if proc.stderr else ""
    wall = time.time() - t0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    step_s = [r["step_s"] for r in rows if "step_s" in r]
    gib = 1 << 30
    out = {
        "shape": {"layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads,
                  "kv_heads": a.kv_heads, "vocab": 151936, "dtype_on_disk": a.dtype},
        "ref_dtype": a.ref_dtype, "worker_dtype": a.worker_dtype, "bf16": a.bf16 == "true",
        "gradient_checkpointing": a.gradient_checkpointing == "true", "extra_args": a.trainer_args,
        "rc": proc.returncode, "steps_done": len(rows),
        "peak_rss_gib": {k: round(v / gib, 3) for k, v in sorted(peaks.items())},
        "peak_total_gib": round(peak_total / gib, 3),  # the box's peak: all processes at the same moment
        "sum_of_peaks_gib": round(sum(peaks.values()) / gib, 3),  # an upper bound of it
        "s_per_step": round(sum(step_s) / len(step_s), 2) if step_s else None,
        "s_per_step_after_first": round(sum(step_s[1:]) / len(step_s[1:]), 2) if len(step_s) > 1 else None,
        "wall_s": round(wall, 1), "build_s": round(build_s, 1),
        "disk_mb": {"final": round(du(run / "final") / 1e6, 1), "ds": round(du(run / "ds") / 1e6, 1),
                    "model_on_disk": round(du(model) / 1e6, 1)},
        "run_dir": str(run),
    }
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
    if a.smoke and scratch:
        shutil.rmtree(scratch, ignore_errors=True)  # checkpoints of a run nobody reads
    print(json.dumps(out))
    if proc.returncode != 0:
        sys.exit(f"the run failed (launch.sh exit {proc.returncode}); its stderr is above")


if __name__ == "__main__":
    main()
