"""The demo: DeepSeek-R1-Zero/R1 in miniature, end to end, on a CPU in minutes (CLI and order of the phases;
the phases themselves are phases.py).

    ./launch.sh demo [--run-dir DIR] [--seed N] [--quick]
    ./launch.sh demo --model Qwen/Qwen2.5-1.5B-Instruct --data openai/gsm8k --config configs/gsm8k_qwen.json

Default (CPU, the embedded tiny model):
  1. build the tiny Qwen2 model and its tokenizer (common/tiny_model.py);
  2. cold-start SFT on worked solutions of the synthetic `a o b o c` task (arith.py) in the
     R1 format, stopped early so the model is able but imperfect;
  3. greedy held-out accuracy and format rate (before);
  4. pure GRPO through the real pipeline, `launch.sh train`: the ref server as its own process, a
     genonly worker and the `deepspeed` trainer with 2 CPU ranks (configs/demo.json);
  5. the same evaluation (after), a before/after table, RUN_DIR/summary.json and RUN_DIR/plot.png.

With --model/--data it runs the real thing (e.g. Qwen2.5 on GSM8K on GPU nodes): no SFT unless
--sft-steps is given (and the data has worked solutions), the data's train/test splits, and
everything after `--` is passed to the trainer.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from common.settings.cli import ArgumentParser
from trainer.demo.phases import Log, cold_start_sft, report, run_eval, run_training, show_samples

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.json"

# The demo's own settings (the GRPO phase's live in configs/demo.json); --quick shrinks them for CI.
DEFAULTS = dict(sft_steps=400, sft_batch_size=64, sft_lr=1e-3, sft_target=0.40, sft_check_from=160, sft_check_every=20,
                sft_dev=200, eval_limit=1000, eval_batch_size=250)
QUICK = dict(sft_steps=30, eval_limit=100, grpo_steps=6, grpo_eval_steps=3, grpo_eval_limit=50)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = ArgumentParser(  # dashes or underscores, no abbreviations, one-line errors (common/settings/cli.py)
        prog="./launch.sh demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="R1-Zero/R1 in miniature: tiny model -> cold-start SFT -> eval -> GRPO (ref server + "
                    "genonly worker + deepspeed ranks) -> eval, with summary.json and plot.png in the run "
                    "directory. Arguments after `--` go to the trainer (e.g. -- --lr 5e-5 --all_steps 100).",
        epilog=__doc__.split("Default (CPU", 1)[0].strip())
    p.add_argument("--run-dir", default=None, help="Output directory (default runs/demo-<timestamp>).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the model init, SFT and GRPO (default 0).")
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized run: {QUICK['sft_steps']} SFT steps, {QUICK['grpo_steps']} GRPO steps, "
                        f"{QUICK['eval_limit']} eval examples (checks the plumbing, not the learning).")
    p.add_argument("--model", default=None, help="Start from this model (HF id or directory) instead of "
                                                  "building the tiny one; then SFT is skipped unless --sft-steps.")
    p.add_argument("--data", default=None, help="Data for --model (hub id, directory or file; default: the "
                                                 "config's data). The tiny demo always uses arith.")
    p.add_argument("--config", default=None, help="Trainer config JSON (default configs/demo.json for the tiny "
                                                   "demo, none with --model).")
    p.add_argument("--sft-steps", type=int, default=None,
                   help=f"Cold-start SFT steps at most (default {DEFAULTS['sft_steps']} for the tiny demo, 0 with "
                        f"--model).")
    p.add_argument("--sft-target", type=float, default=None,
                   help=f"Tiny demo: stop SFT once greedy accuracy on {DEFAULTS['sft_dev']} dev problems (held out "
                        f"of the train split, never the test split) reaches this (checked every "
                        f"{DEFAULTS['sft_check_every']} steps from step {DEFAULTS['sft_check_from']}; default "
                        f"{DEFAULTS['sft_target']}; 0 = run all --sft-steps). Able but imperfect is what GRPO "
                        f"needs.")
    p.add_argument("--sft-batch-size", type=int, default=DEFAULTS["sft_batch_size"])
    p.add_argument("--sft-lr", type=float, default=DEFAULTS["sft_lr"])
    p.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the config's all_steps).")
    p.add_argument("--eval-limit", type=int, default=None,
                   help=f"Held-out examples in the before/after evaluation (default {DEFAULTS['eval_limit']} "
                        f"for the tiny demo, the config's eval_limit with --model).")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help=f"Sequences per generate call in evaluation (default {DEFAULTS['eval_batch_size']} for the "
                        f"tiny demo, the config's gen_batch_size with --model).")
    p.add_argument("--workers", type=int, default=1, help="genonly workers (default 1).")
    p.add_argument("--gpus", type=int, default=None, help="Trainer ranks (default 2 on CPU, all GPUs on CUDA).")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of this process for SFT/eval on CPU (the ranks use 1 each). Default: "
                        "2 when the machine is idle (1-min load average < 1), else 1 - on busy cores a 2-thread "
                        "OpenMP step measured 3x the CPU time of a 1-thread one.")
    a = p.parse_args(argv)
    a.tiny = a.model is None
    if a.tiny and a.data not in (None, "arith"):
        p.error("--data needs --model (the tiny demo trains on the built-in arith task)")
    if a.tiny:
        a.data = "arith"
    if a.sft_steps is None:
        a.sft_steps = (QUICK if a.quick else DEFAULTS)["sft_steps"] if a.tiny else 0
    if a.sft_target is None:
        a.sft_target = DEFAULTS["sft_target"] if a.tiny and not a.quick else 0.0
    if a.config is None and a.tiny:
        a.config = str(DEMO_CONFIG)
    if a.run_dir is None:
        a.run_dir = str(REPO / "runs" / f"demo-{datetime.now():%Y%m%d-%H%M%S}")
    return a, extra


def main(argv: list[str] | None = None) -> int:
    a, extra = parse_args(argv)
    t_start = time.time()
    run_dir = Path(a.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = Log(run_dir / "demo.log")
    # SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, so the training processes are stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from common.config import GRPOConfig
    from common.settings.knobs import load_config_or_exit
    from trainer.metrics import read_metrics

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if a.threads is None:
            a.threads = min(2, os.cpu_count() or 1) if os.getloadavg()[0] < 1.0 else 1
        torch.set_num_threads(a.threads)
        if a.gpus is None:
            a.gpus = 2
    device = "auto"

    # The trainer config: file <- --model/--data <- demo overrides <- what the user put after `--`.
    trainer_args: list[str] = ["--config", a.config] if a.config else []
    if not a.tiny:
        trainer_args += ["--model", a.model]
    if a.data:
        trainer_args += ["--data", a.data]
    trainer_args += ["--seed", str(a.seed)]
    if a.tiny and not on_gpu:
        trainer_args += cpu_precision_args(log)
    if a.quick:
        trainer_args += ["--all_steps", str(QUICK["grpo_steps"]), "--eval_steps", str(QUICK["grpo_eval_steps"]),
                         "--eval_limit", str(QUICK["grpo_eval_limit"])]
    if a.grpo_steps is not None:
        trainer_args += ["--all_steps", str(a.grpo_steps)]
    trainer_args += ["--eval_before", "false"]  # this script evaluates before and after itself
    cfg = load_config_or_exit(GRPOConfig, trainer_args + extra, prog="./launch.sh demo --")
    a.data = cfg.data
    eval_bs = a.eval_batch_size or (DEFAULTS["eval_batch_size"] if a.tiny else cfg.gen_batch_size)
    eval_limit = a.eval_limit or ((QUICK if a.quick else DEFAULTS)["eval_limit"] if a.tiny else cfg.eval_limit)

    log.banner(f"R1 in miniature: run dir {run_dir}")
    log(f"seed {a.seed}   model {'tiny (built here)' if a.tiny else a.model}   data {a.data}   "
        f"SFT steps {a.sft_steps}   GRPO steps {cfg.all_steps}   held-out eval {eval_limit} examples"
        + (f"   torch threads {a.threads}" if not on_gpu else ""))
    timings: dict = {}

    # 1. model ----------------------------------------------------------------------------------
    t0 = time.time()
    if a.tiny:
        from common.tiny_model import build_tiny_model
        log.banner("1/5 build the tiny model and tokenizer")
        model_dir = str(build_tiny_model(run_dir / "base", seed=a.seed))
        from transformers import AutoConfig
        mc = AutoConfig.from_pretrained(model_dir)
        log(f"Qwen2: hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, {mc.num_attention_heads} heads, "
            f"MLP {mc.intermediate_size}, vocab {mc.vocab_size} -> {model_dir}")
    else:
        model_dir = a.model
        log.banner(f"1/5 start model: {model_dir}")
    timings["build_s"] = round(time.time() - t0, 1)

    # 2. cold-start SFT -------------------------------------------------------------------------
    t0 = time.time()
    if a.sft_steps > 0:
        model_dir = cold_start_sft(a, cfg, model_dir, run_dir, log, device, eval_bs,
                                   check={"from": DEFAULTS["sft_check_from"], "every": DEFAULTS["sft_check_every"],
                                          "dev": DEFAULTS["sft_dev"]})
    else:
        log.banner("2/5 cold-start SFT: skipped")
    timings["sft_s"] = round(time.time() - t0, 1)

    # 3. eval before ----------------------------------------------------------------------------
    t0 = time.time()
    log.banner(f"3/5 held-out evaluation before GRPO ({cfg.eval_split} split, {eval_limit} examples, greedy)")
    before = run_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
    log(f"accuracy {100 * before['accuracy']:.1f}%   format {100 * before['format_rate']:.1f}%   "
        f"({before['seconds']:.0f} s)")
    show_samples(log, before)
    timings["eval_before_s"] = round(time.time() - t0, 1)

    # 4. GRPO -------------------------------------------------------------------------------------
    t0 = time.time()
    grpo_dir = run_dir / "grpo"
    log.banner(f"4/5 GRPO: {cfg.all_steps} steps, ref server + {a.workers} genonly worker(s) + deepspeed "
               f"x{a.gpus or 'all GPUs'} (logs in {grpo_dir})")
    train_args = trainer_args + extra + ["--model", model_dir]  # the SFT model is also the reference
    if a.tiny:
        train_args += ["--save_steps", str(10 ** 9)]  # only the final model (saved at the last step anyway)
    rc = run_training(a, train_args, grpo_dir, log)
    timings["grpo_s"] = round(time.time() - t0, 1)
    if rc != 0:
        log(f"[demo] training failed (exit {rc}); see {grpo_dir}/trainer.log, ref_server.log, worker*.log")
        return rc
    final_dir = grpo_dir / "final"
    metrics = read_metrics(grpo_dir / "metrics.jsonl")
    log(f"GRPO done in {timings['grpo_s']:.0f} s; final model {final_dir}")

    # 5. eval after, table, summary, plot --------------------------------------------------------
    t0 = time.time()
    log.banner("5/5 held-out evaluation after GRPO")
    after = run_eval(str(final_dir), a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
    show_samples(log, after)
    timings["eval_after_s"] = round(time.time() - t0, 1)
    wall = time.time() - t_start

    report(a, cfg, before, after, metrics, timings, wall, run_dir, grpo_dir, log)
    return 0


def cpu_precision_args(log) -> list[str]:
    """configs/demo.json trains and samples in bf16, which pays on CPUs with native bf16 (AVX-512 BF16:
    GRPO 290 s vs 398 s float32 here); without it bf16 may well be slower than float32 (not measured), so
    the demo switches to float32 (said in the log; flags after `--` still win)."""
    import torch

    if torch.cpu._is_avx512_bf16_supported():
        return []
    log("this CPU has no AVX-512 BF16: the demo trains and samples in float32 (--bf16 false --vllm_dtype "
        "float32)")
    return ["--bf16", "false", "--vllm_dtype", "float32"]


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def run() -> None:
    """`python -m trainer.demo`: main() with Ctrl-C as exit 130."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[demo] interrupted", file=sys.stderr)
        sys.exit(130)
