"""The demo: DeepSeek-R1-Zero/R1 in miniature, end to end, on a CPU in minutes.

    ./launch.sh demo [--run-dir DIR] [--seed N] [--quick]
    ./launch.sh demo --model Qwen/Qwen2.5-1.5B-Instruct --data openai/gsm8k --config configs/gsm8k_qwen.json

Default (CPU, the embedded tiny model):
  1. build the tiny Qwen2 model and its tokenizer (common/tiny_model.py);
  2. cold-start SFT on worked solutions of the synthetic `a o b o c` task (trainer/arith.py) in the
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
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from trainer.plot import make_plot

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "demo.json"

# The demo's own settings (the GRPO phase's live in configs/demo.json); --quick shrinks them for CI.
DEFAULTS = dict(sft_steps=400, sft_batch_size=64, sft_lr=1e-3, sft_target=0.40, sft_check_from=160, sft_check_every=20,
                sft_dev=200, eval_limit=1000, eval_batch_size=250)
QUICK = dict(sft_steps=30, eval_limit=100, grpo_steps=6, grpo_eval_steps=3, grpo_eval_limit=50)
DEV_HOLDOUT = 500  # the first 500 train-split problems: SFT's stopping check reads them, SFT never trains on them


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
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


class Log:
    """print() to the terminal and to RUN_DIR/demo.log."""

    def __init__(self, path: Path):
        self.fh = path.open("a")

    def __call__(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.fh.write(msg + "\n")
        self.fh.flush()

    def banner(self, msg: str) -> None:
        self(f"\n=== {msg} " + "=" * max(3, 76 - len(msg)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_eval(model_dir: str, data: str, split: str, limit: int, cfg, batch_size: int, device: str) -> dict:
    from common.modeling import load_model, load_tokenizer
    from trainer.data import load_examples
    from trainer.evaluate import evaluate

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype="auto")
    res = evaluate(model, tok, load_examples(data, split=split, limit=limit), system_prompt=cfg.system_prompt,
                   max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, batch_size=batch_size, num_samples=5, progress=False)
    del model
    _free_cuda()
    return res


def _free_cuda() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_training(a, trainer_args: list[str], grpo_dir: Path, log: Log) -> int:
    """`launch.sh train` in its own process group; on any exit path that group is stopped, and
    launch.sh's own trap then stops the ref server and workers."""
    cmd = [str(REPO / "launch.sh"), "train", "--run-dir", str(grpo_dir), "--workers", str(a.workers),
           "--port", str(free_port())]
    if a.gpus is not None:
        cmd += ["--gpus", str(a.gpus)]
    cmd += ["--", *trainer_args]
    log("$ " + " ".join(cmd))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            log("[demo] stopping the training processes")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
    from common.knobs import load_config
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
    if a.quick:
        trainer_args += ["--all_steps", str(QUICK["grpo_steps"]), "--eval_steps", str(QUICK["grpo_eval_steps"]),
                         "--eval_limit", str(QUICK["grpo_eval_limit"])]
    if a.grpo_steps is not None:
        trainer_args += ["--all_steps", str(a.grpo_steps)]
    trainer_args += ["--eval_before", "false"]  # this script evaluates before and after itself
    cfg = load_config(GRPOConfig, trainer_args + extra)
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
        from common.modeling import load_model, load_tokenizer
        from trainer.data import load_examples
        from trainer.sft import sft
        log.banner(f"2/5 cold-start SFT: up to {a.sft_steps} steps x {a.sft_batch_size} worked solutions, lr {a.sft_lr}"
                   + (f", until dev accuracy >= {100 * a.sft_target:.0f}%" if a.sft_target > 0 else ""))
        train_examples = load_examples(a.data, split=cfg.data_split, limit=cfg.data_limit)
        dev: list = []
        if a.data == "arith":
            from trainer.arith import solution_text
            solution_fn = solution_text
            if a.sft_target > 0:
                dev, train_examples = train_examples[:DEV_HOLDOUT][:DEFAULTS["sft_dev"]], train_examples[DEV_HOLDOUT:]
        else:  # GSM8K-style rows keep their worked solution in meta["solution"]
            examples = load_examples(a.data, split=cfg.data_split, limit=cfg.data_limit)
            sols = {ex.prompt: ex.meta.get("solution") for ex in examples}
            if not all(sols.values()):
                raise SystemExit(f"--sft-steps: {a.data} has no worked solutions to train on")
            solution_fn = lambda p: _r1_format(sols[p])  # noqa: E731
        tok = load_tokenizer(model_dir)
        model = load_model(model_dir, device=device, dtype="float32", trainable=True)
        sp = _system_prompt(cfg.system_prompt)

        def on_step(i: int, loss: float) -> bool:
            check = dev and i >= DEFAULTS["sft_check_from"] and i % DEFAULTS["sft_check_every"] == 0
            if not check:
                if i % 50 == 0:
                    log(f"  SFT step {i}/{a.sft_steps}  loss {loss:.3f}  ({time.time() - t0:.0f} s)")
                return False
            from trainer.evaluate import evaluate
            acc = evaluate(model, tok, dev, system_prompt=sp, max_new_tokens=cfg.max_new_tokens,
                           batch_size=eval_bs, progress=False)["accuracy"]
            log(f"  SFT step {i}/{a.sft_steps}  loss {loss:.3f}  dev accuracy {100 * acc:.1f}%  "
                f"({time.time() - t0:.0f} s)")
            return acc >= a.sft_target

        losses = sft(model, tok, train_examples, solution_fn, steps=a.sft_steps, batch_size=a.sft_batch_size,
                     lr=a.sft_lr, seed=a.seed, system_prompt=sp, progress=False, on_step=on_step)
        a.sft_steps = len(losses)
        sft_dir = run_dir / "sft"
        model.save_pretrained(sft_dir, safe_serialization=True)
        tok.save_pretrained(sft_dir)
        model_dir = str(sft_dir)
        del model
        _free_cuda()
        log(f"SFT {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - t0:.0f} s; "
            f"saved to {sft_dir}")
    else:
        log.banner("2/5 cold-start SFT: skipped")
    timings["sft_s"] = round(time.time() - t0, 1)

    # 3. eval before ----------------------------------------------------------------------------
    t0 = time.time()
    log.banner(f"3/5 held-out evaluation before GRPO ({cfg.eval_split} split, {eval_limit} examples, greedy)")
    before = run_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
    log(f"accuracy {100 * before['accuracy']:.1f}%   format {100 * before['format_rate']:.1f}%   "
        f"({before['seconds']:.0f} s)")
    _show_samples(log, before)
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
    _show_samples(log, after)
    timings["eval_after_s"] = round(time.time() - t0, 1)
    wall = time.time() - t_start

    d_acc = 100 * (after["accuracy"] - before["accuracy"])
    d_fmt = 100 * (after["format_rate"] - before["format_rate"])
    log("")
    log(f"{'held-out (' + str(before['n']) + ' examples)':<28}{'before':>10}{'after':>10}{'change':>10}")
    log(f"{'accuracy':<28}{100 * before['accuracy']:>9.1f}%{100 * after['accuracy']:>9.1f}%{d_acc:>+9.1f}")
    log(f"{'format':<28}{100 * before['format_rate']:>9.1f}%{100 * after['format_rate']:>9.1f}%{d_fmt:>+9.1f}")
    train_rows = [r for r in metrics if "reward_mean" in r]
    if train_rows:
        k = max(1, len(train_rows) // 10)
        r0 = sum(r["reward_mean"] for r in train_rows[:k]) / k
        r1 = sum(r["reward_mean"] for r in train_rows[-k:]) / k
        log(f"{'train reward (first/last ' + str(k) + ')':<28}{r0:>10.3f}{r1:>10.3f}{r1 - r0:>+10.3f}")

    summary = {
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "format_before": before["format_rate"], "format_after": after["format_rate"],
        "steps": cfg.all_steps, "wall_seconds": round(wall, 1), "seed": a.seed,
        "eval_examples": before["n"], "sft_steps": a.sft_steps, "model": "tiny" if a.tiny else a.model,
        "data": a.data, "timings": timings, "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot = run_dir / "plot.png"
    make_plot(metrics, before, after, cfg.all_steps, plot,
              f"GRPO on {'a o b o c arithmetic (tiny Qwen2)' if a.tiny else a.data}, seed {a.seed}: "
              f"held-out accuracy {100 * before['accuracy']:.1f}% -> {100 * after['accuracy']:.1f}% "
              f"({d_acc:+.1f} points)")
    log(f"\nwall time {wall:.0f} s ({', '.join(f'{k[:-2]} {v:.0f}' for k, v in timings.items())})")
    log(f"summary: {run_dir / 'summary.json'}\nplot:    {plot}\nlogs:    {run_dir}/demo.log, {grpo_dir}/*.log")
    return 0


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _system_prompt(sp: str | None) -> str | None:
    from common.prompts import SYSTEM_PROMPT
    return SYSTEM_PROMPT if sp == "default" else sp


def _r1_format(solution: str) -> str:
    """A GSM8K worked solution ("... #### 72") as `<think>...</think><answer>72</answer>`."""
    body, _, final = solution.rpartition("####")
    return f"<think>{body.strip()}</think><answer>{final.strip()}</answer>"


def _show_samples(log: Log, res: dict, n: int = 3) -> None:
    for s in res.get("samples", [])[:n]:
        mark = "ok " if s["correct"] else "bad"
        log(f"  [{mark}] {s['prompt']!r:>12} -> {s['completion'][:90]!r} (answer {s['ground_truth']})")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[demo] interrupted", file=sys.stderr)
        sys.exit(130)
