"""Side by side with TRL 1.16's GRPOTrainer on the demo's work (issue 45): the same SFT checkpoint, the same arith
prompts and rewards, N steps each, CPU-seconds over every process of each run. A TRL step generates 64 completions
(8 prompts x 8) and trains all 64, its groups without reward spread included (advantage 0: only their KL term acts);
ours generates rounds of 64 and trains a step of 6 groups that have spread (48 completions; configs/demo.json's
train_batch_groups 3 for two ranks, dynamic sampling), ~1.3 rounds a step.

    .venv/bin/python bench/vs_trl.py --steps 500 --seed 0     # the issue's run (~15 min idle on 2 cores)
    .venv/bin/python bench/vs_trl.py --smoke                  # a few steps each, 20 held-out problems

1. The start model: the demo's cold-start SFT checkpoint, built as `./launch.sh demo` builds it (the tiny model of
   common/tiny_model.py, then trainer/demo/phases.cold_start_sft with the demo's settings and --seed), or --sft DIR.
2. TRL: bench/vs_trl_lib/trl_grpo.py, once per --trl-threads setting (default 1 and 2 threads: TRL's most frugal
   and its default on 2 cores), with this Python where it has trl==1.16.0 (the project pins it), else in TRL's own
   virtual environment (--trl-venv; created on first use with `trl==1.16.0` from the package registry and the
   project's CPU torch, transformers and accelerate at .venv's versions). GRPOConfig: per_device_train_batch_size 64,
   num_generations 8, max_completion_length 32, temperature 1.0, beta 0.04, learning_rate 1e-4 constant,
   loss_type grpo, scale_rewards group, epsilon 0.2, adam betas (0.9, 0.99), max_grad_norm 1.0, fp32, no eval, no
   saving (the final model is saved once, for the evaluation below). Prompts: the train split templated exactly
   as our trainer templates it (a JSONL file); rewards: the project's `correct` + `format`.
3. Ours: `launch.sh train --workers 1` with configs/demo.json (the ref server, one worker, the CPU ranks launch.sh
   chooses: common/placement/cpu_ranks.py), its `auto` precision and engine as resolved on this machine (bf16 only
   where the CPU has it natively; HF or vLLM from the measured table of common/placement/gen_choice.py; reported
   from the run's config.json), --eval_steps 0 (no in-training eval: TRL runs none either), only the final model
   saved.
4. Measured per run: CPU-seconds over ALL its processes (bench/vs_trl_lib/cpu_meter.py: the process tree sampled
   every 0.5 s, each process's user + system time; the larger of that sum and getrusage(RUSAGE_CHILDREN), each a
   lower bound of the truth), wall, steps per CPU-s, groups with reward spread trained per CPU-s (ours: the groups
   the ranks trained, logged per step - ours trains only groups with spread; TRL: 8 groups a step x (1 -
   frac_reward_zero_std), from its per-step logs), held-out accuracy (greedy, the project's evaluation code,
   trainer/demo/phases.run_eval, on both final models). The SFT model's accuracy is reported too.
   Printed: the CPU (model, kernel flags, ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA caps, what bf16 auto resolves
   to), a table, ours against each TRL setting (steps and spread groups per CPU-s, both walls), the per-process
   CPU of every run, and a last JSON line with vs_trl {threads: ratios and walls}, steps_per_cpu_s_ratio and
   spread_groups_per_cpu_s_ratio (ours / TRL at its fewest threads), accuracy_ours, accuracy_trl, cpu and the raw
   figures.

--smoke (the suite's size): SFT 2 steps, 3 GRPO steps each side, 8 held-out problems, the first 64 train prompts
written for TRL, TRL on 1 thread only (the suite's box is shared), our `launch.sh train` with --skip-checks and one
rank and an HF worker (neither the checks, a second rank nor vLLM's ~25 CPU-s start-up is what a smoke run looks at:
it is mostly start-up; vLLM workers have their own end-to-end tests), and without
--run-dir a temporary run folder, removed at the end (nothing left in the checkout). --smoke never creates TRL's
environment (the suite has no network): with this Python's own trl 1.16 it runs both sides; without it, it runs our
side and exits 77 (the suite's "skipped: this machine lacks ...") with the reason as its last line.
The machine is shared: compare CPU-seconds, and note the load average printed at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # vs_trl_lib
sys.path.insert(0, str(REPO))  # before bench/: the project's packages (ref_server/), not bench's files of that name

from vs_trl_lib import trl_env  # noqa: E402
from vs_trl_lib.cpu_meter import run_measured  # noqa: E402
from vs_trl_lib.machine import cpu_info  # noqa: E402
from vs_trl_lib.report import comparisons, figures, role, say, table  # noqa: E402

DEMO_CONFIG = REPO / "configs" / "demo.json"
TRL_SCRIPT = REPO / "bench" / "vs_trl_lib" / "trl_grpo.py"
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo-vs-trl" / "venv"
GROUPS_PER_TRL_STEP = 64 // 8  # per_device_train_batch_size / num_generations
SMOKE = dict(steps=3, sft_steps=2, eval_limit=8, prompts=64)  # every code path once; 64 prompts: 8 TRL steps' worth
SKIPPED = 77  # tests/test_bench_smoke.py: a smoke run this machine cannot host


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/vs_trl.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps of each run (default 500; 3 with --smoke)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model, SFT and both GRPO runs (default 0)")
    p.add_argument("--sft", default=None, help="start from this SFT checkpoint instead of building the demo's")
    p.add_argument("--trl-venv", default=None, help="TRL's virtual environment (created on first use). Default: "
                   f"this Python when it has trl==1.16.0 (the project's pinned TRL), else {DEFAULT_VENV}")
    p.add_argument("--setup-trl", action="store_true", help="only create TRL's environment, then exit")
    p.add_argument("--run-dir", default=None, help="output folder (default runs/vs_trl-<timestamp>; with --smoke "
                   "a temporary folder, removed at the end)")
    p.add_argument("--eval-limit", type=int, default=1000, help="held-out problems, greedy (default 1000)")
    p.add_argument("--trl-threads", default=None,
                   help="TRL's torch threads, one TRL run each, comma-separated (default 1,2: TRL's most frugal "
                        "setting and its default on 2 cores; 1 with --smoke). On a busy shared box a 2-thread run's "
                        "second OpenMP thread spins for a core (measured ~7x the CPU-s a step)")
    p.add_argument("--only", choices=("both", "ours", "trl"), default="both",
                   help="run one side only (no ratios then; for profiling); default both")
    p.add_argument("--ranks", type=int, default=None,
                   help="our trainer ranks (launch.sh --gpus N; default: launch.sh's, 1 or 2 on CPU as "
                   "measured; 1 with --smoke)")
    p.add_argument("--ours-args", default="",
                   help="extra trainer arguments for our side, one string, after configs/demo.json's (e.g. "
                        "\"--Q_batch_size 16\"): to measure a variant; the default run is the issue's")
    p.add_argument("--smoke", action="store_true", help="the suite's size (see below)")
    a = p.parse_args(argv)
    if a.steps is None:
        a.steps = SMOKE["steps"] if a.smoke else 500
    if a.trl_threads is None:  # --smoke: the suite's box is shared, where a second thread spins (see --trl-threads)
        a.trl_threads = "1" if a.smoke else "1,2"
    try:
        a.trl_threads = sorted({int(t) for t in str(a.trl_threads).split(",") if t.strip()})
    except ValueError:
        p.error(f"--trl-threads {a.trl_threads!r}: give thread counts like 1,2")
    if not a.trl_threads or min(a.trl_threads) < 1:
        p.error("--trl-threads: at least one thread count, each >= 1")
    if a.smoke:
        a.eval_limit = SMOKE["eval_limit"]
        a.ranks = a.ranks or 1  # as bench/memory_qwen05b.py's smoke: a second rank's start-up measures nothing there
        a.ours_args = f"--gen_backend hf {a.ours_args}"  # a later --gen_backend in --ours-args still wins
    if a.steps < 1 or a.eval_limit < 1:
        p.error("--steps and --eval-limit must be >= 1")
    if a.ranks is not None and a.ranks < 1:
        p.error("--ranks must be >= 1")
    a.ours_args = shlex.split(a.ours_args)
    a.scratch = a.smoke and a.run_dir is None  # a smoke run nobody reads: not in the checkout, removed at the end
    if a.scratch:
        a.run_dir = tempfile.mkdtemp(prefix="vs_trl-smoke-")
    a.run_dir = Path(a.run_dir or REPO / "runs" / f"vs_trl-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    return a


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def sft_checkpoint(a, run_dir: Path) -> str:
    """The demo's cold-start SFT checkpoint, built by the demo's own functions (trainer/demo) with its settings."""
    import torch

    from common.config import GRPOConfig
    from common.settings.knobs import load_config_or_exit
    from common.tiny_model import build_tiny_model
    from trainer.demo.cli import DEFAULTS
    from trainer.demo.cli import parse_args as demo_args
    from trainer.demo.phases import Log, cold_start_sft

    demo_argv = ["--run-dir", str(run_dir), "--seed", str(a.seed)]
    if a.smoke:
        demo_argv += ["--sft-steps", str(SMOKE["sft_steps"]), "--sft-target", "0"]
    d, _ = demo_args(demo_argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cfg = load_config_or_exit(GRPOConfig, ["--config", str(DEMO_CONFIG), "--seed", str(a.seed)],
                              prog="bench/vs_trl.py")
    log = Log(run_dir / "sft.log")
    base = str(build_tiny_model(run_dir / "base", seed=a.seed))
    return cold_start_sft(d, cfg, base, run_dir, log, "auto", DEFAULTS["eval_batch_size"],
                          check={"from": DEFAULTS["sft_check_from"], "every": DEFAULTS["sft_check_every"],
                                 "dev": DEFAULTS["sft_dev"]})


def demo_cfg(a):
    from common.config import GRPOConfig
    from common.settings.knobs import load_config_or_exit
    return load_config_or_exit(GRPOConfig, ["--config", str(DEMO_CONFIG), "--seed", str(a.seed), *a.ours_args],
                               prog="bench/vs_trl.py")


def write_prompts(cfg, model_dir: str, path: Path, limit: int | None = None) -> int:
    """The train split (its first `limit` rows) as our trainer templates it (trainer/rollout.encode_prompts): TRL
    takes text as it is."""
    from common.modeling import load_tokenizer
    from common.prompts import SYSTEM_PROMPT
    from trainer.data.loading import load_examples
    from trainer.data.prompt_formats import build_prompt, resolve_format

    tok = load_tokenizer(model_dir, cfg.load_options())
    rows = []
    limits = [x for x in (cfg.data_limit, limit) if x]
    limit = min(limits) if limits else None
    for ex in load_examples(cfg.data, split=cfg.data_split, limit=limit):
        fmt = resolve_format(cfg.prompt_format, ex.prompt)
        system = (SYSTEM_PROMPT if fmt == "chat" else None) if cfg.system_prompt == "default" else cfg.system_prompt
        rows.append({"prompt": build_prompt(tok, ex.prompt, system, fmt, None, cfg.chat_template_kwargs),
                     "ground_truth": ex.ground_truth})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def run_trl(a, python: Path, sft: str, prompts: Path, out: Path, threads: int) -> dict:
    cmd = [str(python), str(TRL_SCRIPT), "--model", sft, "--data", str(prompts), "--out", str(out),
           "--steps", str(a.steps), "--seed", str(a.seed), "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH="")
    say(f"[vs_trl] TRL, {threads} thread(s): {' '.join(cmd)}")
    log_path = out.parent / f"{out.name}.log"
    m = run_measured(cmd, env=env, cwd=str(out.parent), log_path=log_path, label=role)
    if m.rc != 0:
        raise SystemExit(f"[vs_trl] the TRL run failed (exit {m.rc}); see {log_path}")
    logs = json.loads((out / "log_history.json").read_text())
    steps = [r for r in logs if "frac_reward_zero_std" in r]
    if len(steps) != a.steps:
        raise SystemExit(f"[vs_trl] TRL logged {len(steps)} steps of {a.steps} (logging_steps 1): cannot count groups")
    spread = sum(GROUPS_PER_TRL_STEP * (1.0 - r["frac_reward_zero_std"]) for r in steps)
    return dict(measured=m, steps=len(steps), spread_groups=round(spread, 1), final=str(out / "final"),
                reward_first=steps[0]["reward"], reward_last=steps[-1]["reward"])


def run_ours(a, sft: str, out: Path) -> dict:
    from common.listen import free_port
    from trainer.run.metrics import read_metrics

    cmd = [str(REPO / "launch.sh"), "train", *(["--skip-checks"] if a.smoke else []), "--run-dir", str(out),
           "--workers", "1", "--port", str(free_port()), *(["--gpus", str(a.ranks)] if a.ranks else []),
           "--", "--config", str(DEMO_CONFIG), "--model", sft, "--seed", str(a.seed), "--all_steps", str(a.steps),
           "--eval_before", "false", "--eval_steps", "0", "--save_steps", str(10 ** 9), *a.ours_args]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    say(f"[vs_trl] ours: {' '.join(cmd)}")
    m = run_measured(cmd, env=env, cwd=str(REPO), log_path=out.parent / "ours.log", label=role)
    if m.rc != 0:
        raise SystemExit(f"[vs_trl] our run failed (exit {m.rc}); see {out.parent / 'ours.log'} and {out}/*.log")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "batches_from_workers" in r]
    if len(rows) != a.steps:
        raise SystemExit(f"[vs_trl] our run logged {len(rows)} steps of {a.steps}: cannot count groups")
    run_cfg = json.loads((out / "config.json").read_text())  # as rank 0 resolved it on this machine (auto values)
    # a rank's training batch is train_batch_groups groups, each with reward spread (the run's: one CPU rank takes
    # twice the groups of two, common/placement/cpu_ranks.py); the rows count every rank's batches
    spread = run_cfg["train_batch_groups"] * sum(r["batches_from_workers"] + r["batches_from_ranks"] for r in rows)
    return dict(measured=m, steps=len(rows), spread_groups=spread, final=str(out / "final"),
                reward_first=rows[0]["reward_mean"], reward_last=rows[-1]["reward_mean"],
                resolved={k: run_cfg[k] for k in ("bf16", "vllm_dtype", "gen_backend", "train_batch_groups")})


def evaluate(model_dir: str, cfg, limit: int) -> float:
    from trainer.demo.cli import DEFAULTS
    from trainer.demo.phases import run_eval
    return run_eval(model_dir, cfg.data, cfg.eval_split, limit, cfg, DEFAULTS["eval_batch_size"], "auto")["accuracy"]


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: run_measured then stops the run's whole session


def trl_python(a) -> Path | None:
    """TRL's Python: --trl-venv's (created unless --smoke), else this one where it has trl 1.16, else the default
    venv's; None: --smoke where none is ready (never created there: the suite has no network)."""
    if a.trl_venv is None and trl_env.project_has_trl():
        return Path(sys.executable)
    venv = Path(a.trl_venv or DEFAULT_VENV).expanduser().resolve()
    if a.setup_trl or not a.smoke:
        return trl_env.ensure(venv, REPO, say)  # first: a missing registry stops the bench before the long parts
    return trl_env.python_of(venv) if trl_env.ready(venv) else None


def main(argv=None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    want_trl = a.only in ("both", "trl") or a.setup_trl
    python = trl_python(a) if want_trl else None
    if a.setup_trl:
        say(f"[vs_trl] TRL's Python: {python}")
        return 0
    a.run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    machine = cpu_info()
    say(f"[vs_trl] run dir {a.run_dir}; {a.steps} steps, seed {a.seed}; load average {load()}")
    say(f"[vs_trl] CPU: {machine['model']}, {os.cpu_count()} cores; flags {' '.join(machine['flags'])}; "
        f"{machine['bf16']}" + "".join(f"; {k}={v}" for k, v in machine["caps"].items()))
    t0 = time.time()
    sft = a.sft or sft_checkpoint(a, a.run_dir)
    cfg = demo_cfg(a)
    prompts = a.run_dir / "prompts.jsonl"
    n = write_prompts(cfg, sft, prompts, SMOKE["prompts"] if a.smoke else None)
    say(f"[vs_trl] SFT checkpoint {sft}; {n} train prompts -> {prompts}")
    acc_sft = evaluate(sft, cfg, a.eval_limit)
    say(f"[vs_trl] SFT start: held-out accuracy {100 * acc_sft:.1f}% ({a.eval_limit} problems, greedy)")
    runs: dict = {}
    loads = {"start": load()}
    if want_trl and python is not None:
        for threads in a.trl_threads:
            name = f"trl_{threads}t"
            r = run_trl(a, python, sft, prompts, a.run_dir / name, threads)
            runs[name] = dict(figures(r, evaluate(r["final"], cfg, a.eval_limit)), threads=threads)
            loads[f"after_{name}"] = load()
            # kept if ours fails
            (a.run_dir / f"result_{name}.json").write_text(json.dumps(runs[name], indent=1) + "\n")
    if a.only in ("both", "ours"):
        r = run_ours(a, sft, a.run_dir / "ours")
        runs["ours"] = dict(figures(r, evaluate(r["final"], cfg, a.eval_limit)), resolved=r["resolved"])
        loads["after_ours"] = load()
    table(runs, acc_sft, a.eval_limit)
    result = dict(steps=a.steps, seed=a.seed, eval_limit=a.eval_limit, accuracy_sft=acc_sft, load_average=loads,
                  wall_s=round(time.time() - t0, 1), run_dir=str(a.run_dir), cpu=machine, runs=runs)
    versus = comparisons(runs)
    if versus:  # ours against each TRL setting; the headline figures against TRL's first (fewest threads)
        first = versus[min(versus)]
        result = dict(steps_per_cpu_s_ratio=first["steps_per_cpu_s_ratio"],
                      spread_groups_per_cpu_s_ratio=first["spread_groups_per_cpu_s_ratio"],
                      accuracy_ours=runs["ours"]["accuracy"], accuracy_trl=runs[f"trl_{min(versus)}t"]["accuracy"],
                      vs_trl=versus, **result)
    (a.run_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    if a.scratch:
        shutil.rmtree(a.run_dir, ignore_errors=True)
        say(f"[vs_trl] --smoke: removed the temporary run folder {a.run_dir} (pass --run-dir to keep one)")
    if want_trl and python is None:  # --smoke without TRL's environment: our side ran; TRL's cannot here
        say(json.dumps(result))
        say(f"skipped the TRL side: no TRL in this Python and no TRL environment at {a.trl_venv or DEFAULT_VENV}; "
            f"--smoke never creates one (it needs the package registry): `bench/vs_trl.py --setup-trl` creates it")
        return SKIPPED
    say(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(code)
