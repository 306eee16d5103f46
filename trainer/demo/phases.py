"""The demo's phases (cli.py runs them in order): cold-start SFT, held-out evaluation, the GRPO run
through `launch.sh train`, and the before/after report (table, summary.json, plot.png)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from common.listen import free_port
from trainer.demo.plot import make_plot
from trainer.demo.tool_report import agent_summary, agent_table, tool_summary, tool_table

REPO = Path(__file__).resolve().parents[2]
DEV_HOLDOUT = 500  # the first 500 train-split problems: SFT's stopping check reads them, SFT never trains on them


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


def run_eval(model_dir: str, data: str, split: str, limit: int, cfg, batch_size: int, device: str) -> dict:
    from dataclasses import replace

    from common.modeling import load_model, load_tokenizer
    from trainer.data import run_data
    from trainer.evaluate import evaluate

    # held-out rows chosen as the trainer chooses them (eval_data, else data's split; never the training rows)
    examples = run_data.eval_examples(replace(cfg, data=data, eval_split=split, eval_limit=limit, eval_before=True))
    tok = load_tokenizer(model_dir, cfg.load_options())
    model = load_model(model_dir, device=device, dtype="auto", options=cfg.load_options())
    res = evaluate(model, tok, examples, system_prompt=cfg.system_prompt,
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


def cold_start_sft(a, cfg, model_dir: str, run_dir: Path, log: Log, device: str, eval_bs: int,
                   check: dict) -> str:
    """SFT on worked solutions in the R1 format until `a.sft_target` dev accuracy (checked from step
    check["from"] every check["every"] steps on check["dev"] problems held out of the train split) or
    `a.sft_steps`; returns the saved model's directory. Sets a.sft_steps to the steps done."""
    from common.modeling import load_model, load_tokenizer
    from trainer.data.loading import load_examples
    from trainer.demo.sft import sft

    t0 = time.time()
    log.banner(f"2/5 cold-start SFT: up to {a.sft_steps} steps x {a.sft_batch_size} worked solutions, lr {a.sft_lr}"
               + (f", until dev accuracy >= {100 * a.sft_target:.0f}%" if a.sft_target > 0 else ""))
    train_examples = load_examples(a.data, split=cfg.data_split, limit=cfg.data_limit)
    dev: list = []
    if a.data == "arith":
        from trainer.demo.arith import solution_text
        solution_fn = solution_text
        if a.sft_target > 0:
            dev, train_examples = train_examples[:DEV_HOLDOUT][:check["dev"]], train_examples[DEV_HOLDOUT:]
    else:  # GSM8K-style rows keep their worked solution in meta["solution"]
        sols = {ex.prompt: ex.meta.get("solution") for ex in train_examples}
        if not all(sols.values()):
            raise SystemExit(f"--sft-steps: {a.data} has no worked solutions to train on")
        solution_fn = lambda p: _r1_format(sols[p])  # noqa: E731
    tok = load_tokenizer(model_dir, cfg.load_options())
    model = load_model(model_dir, device=device, dtype="float32", trainable=True, options=cfg.load_options())
    sp = _system_prompt(cfg.system_prompt)

    def on_step(i: int, loss: float) -> bool:
        if not (dev and i >= check["from"] and i % check["every"] == 0):
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
    model = None  # (not del: on_step's closure refers to it) frees the weights before the next phase
    _free_cuda()
    log(f"SFT {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - t0:.0f} s; "
        f"saved to {sft_dir}")
    return str(sft_dir)


def report(a, cfg, before: dict, after: dict, metrics: list[dict], timings: dict, wall: float, run_dir: Path,
           grpo_dir: Path, log: Log, without: dict | None = None, agent: bool = False) -> None:
    """The before/after table on the terminal, RUN_DIR/summary.json and RUN_DIR/plot.png. `without`: the tool
    demo's evaluation of the SFT model with tools disabled; `agent`: the agent demo's evaluations (their tables and
    summary keys are tool_report.py's)."""
    d_acc = 100 * (after["accuracy"] - before["accuracy"])
    if agent:
        agent_table(log, before, after)
    elif without is not None:
        tool_table(log, before, after, without)
    else:
        d_fmt = 100 * (after["format_rate"] - before["format_rate"])
        log("")
        log(f"{'held-out (' + str(before['n']) + ' examples)':<28}{'before':>10}{'after':>10}{'change':>10}")
        log(f"{'accuracy':<28}{100 * before['accuracy']:>9.1f}%{100 * after['accuracy']:>9.1f}%{d_acc:>+9.1f}")
        log(f"{'format':<28}{100 * before['format_rate']:>9.1f}%{100 * after['format_rate']:>9.1f}%"
            f"{d_fmt:>+9.1f}")
    train_rows = [r for r in metrics if "reward_mean" in r]
    if train_rows:
        k = max(1, len(train_rows) // 10)
        r0 = sum(r["reward_mean"] for r in train_rows[:k]) / k
        r1 = sum(r["reward_mean"] for r in train_rows[-k:]) / k
        log(f"{'train reward (first/last ' + str(k) + ')':<28}{r0:>10.3f}{r1:>10.3f}{r1 - r0:>+10.3f}")

    summary = {
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "steps": cfg.all_steps, "wall_seconds": round(wall, 1), "seed": a.seed,
        "eval_examples": before["n"], "sft_steps": a.sft_steps, "model": "tiny" if a.tiny else a.model,
        "data": a.data, "timings": timings, "run_dir": str(run_dir),
    }
    if agent:
        summary.update(agent_summary(before, after), agent=cfg.agent)
    elif without is not None:
        summary.update(tool_summary(before, after, without), tools=list(cfg.tools))
    else:  # the plain demo's R1 format (the tool and agent traces have their own)
        summary.update(format_before=before["format_rate"], format_after=after["format_rate"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot = run_dir / "plot.png"
    make_plot(metrics, before, after, cfg.all_steps, plot,
              f"GRPO on {_task_name(a)}, seed {a.seed}: "
              f"held-out accuracy {100 * before['accuracy']:.1f}% -> {100 * after['accuracy']:.1f}% "
              f"({d_acc:+.1f} points)")
    log(f"\nwall time {wall:.0f} s ({', '.join(f'{k[:-2]} {v:.0f}' for k, v in timings.items())})")
    log(f"summary: {run_dir / 'summary.json'}\nplot:    {plot}\nlogs:    {run_dir}/demo.log, {grpo_dir}/*.log")


def _task_name(a) -> str:
    if not a.tiny:
        return a.data
    if getattr(a, "agent", False):
        return "ab*cd+e, an openai-SDK agent with a calculator (tiny Qwen2)"
    return "ab*cd+e with a calculator (tiny Qwen2)" if a.data == "arith_tools" else "a o b o c arithmetic (tiny Qwen2)"


def _system_prompt(sp: str | None) -> str | None:
    from common.prompts import SYSTEM_PROMPT
    return SYSTEM_PROMPT if sp == "default" else sp


def _r1_format(solution: str) -> str:
    """A GSM8K worked solution ("... #### 72") as `<think>...</think><answer>72</answer>`."""
    body, _, final = solution.rpartition("####")
    return f"<think>{body.strip()}</think><answer>{final.strip()}</answer>"


def show_samples(log: Log, res: dict, n: int = 3) -> None:
    for s in res.get("samples", [])[:n]:
        mark = "ok " if s["correct"] else "bad"
        log(f"  [{mark}] {s['prompt']!r:>12} -> {s['completion'][:90]!r} (answer {s['ground_truth']})")
