"""The demo: DeepSeek-R1-Zero/R1 in miniature, end to end, on a CPU in minutes (CLI and order of the phases;
the phases themselves are phases.py).

    ./launch.sh demo [--run-dir DIR] [--seed N] [--quick]
    ./launch.sh demo --tools [--run-dir DIR] [--seed N] [--quick]      # multi-turn, with the calculator
    ./launch.sh demo --agent [--run-dir DIR] [--seed N] [--quick]      # an openai-SDK agent as the rollout
    ./launch.sh demo --model Qwen/Qwen2.5-1.5B-Instruct --data openai/gsm8k --config configs/gsm8k_qwen.json

Default (CPU, the embedded tiny model):
  1. build the tiny Qwen2 model and its tokenizer (common/tiny_model.py);
  2. cold-start SFT on worked solutions of the synthetic `a o b o c` task (arith.py) in the
     R1 format, stopped early so the model is able but imperfect;
  3. greedy held-out accuracy and format rate (before);
  4. pure GRPO through the real pipeline, `launch.sh train`: the ref server as its own process, a
     genonly worker and the `deepspeed` trainer, its CPU ranks as launch.sh chooses (configs/demo.json);
  5. the same evaluation (after), a before/after table, RUN_DIR/summary.json and RUN_DIR/plot.png.

With --tools (issue 32) the same five phases teach tool use instead: the task is `ab*cd+e` (tool_task.py), beyond
the tiny model's own arithmetic but easy with the built-in `calculator`; SFT on a mix of traces with and without a
call (tool_sft.py), then GRPO whose rollouts are multi-turn (configs/demo_tools.json: `tools`); the evaluations
run with the tools, and once without them (accuracy_without_tools), and the summary adds the tool calls per
completion before and after (tool_phases.py).

With --agent (issue 61) the task and SFT are the tool demo's, but the rollout is a user's program: the openai-SDK
agent examples/agents/calculator_agent.py, called by the genonly worker against its OpenAI-compatible endpoint
(configs/demo_agent.json: `agent`); the evaluations run that agent, greedy, against the same endpoint over an HF
engine (agent_phases.py).

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

from common.settings.argparser import ArgumentParser
from trainer.demo.agent_phases import AGENT_SPEC, run_agent_eval, sft_config, show_agent_samples
from trainer.demo.phases import Log, cold_start_sft, report, run_eval, run_training, show_samples
from trainer.demo.tool_phases import run_tool_eval, show_tool_samples, tool_cold_start_sft
from trainer.dist.hosts import caller_path

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.json"
TOOLS_CONFIG = REPO / "configs" / "demo_tools.json"
AGENT_CONFIG = REPO / "configs" / "demo_agent.json"

# The demo's own settings (the GRPO phase's live in configs/demo.json); --quick shrinks them for CI.
DEFAULTS = dict(sft_steps=400, sft_batch_size=64, sft_lr=1e-3, sft_target=0.40, sft_check_from=160, sft_check_every=20,
                sft_dev=200, eval_limit=1000, eval_batch_size=250)
# --quick's GRPO steps are 2 prompts x 8 answers a round and one group a rank a step (the configs' 8 and 4): the
# plumbing is the same, each step a quarter of the work
QUICK = dict(sft_steps=30, eval_limit=100, grpo_steps=6, grpo_eval_steps=3, grpo_eval_limit=50, grpo_prompts=2,
             grpo_groups=1)
# --tools: sized from SFT probes and full runs on 2 CPU cores (docs/benchmarks.md#the-tool-demo): fewer or larger
# steps (250 x 32 at lr 3e-3) left the calls' expressions or the copied results wrong
TOOLS = dict(sft_steps=500, sft_batch_size=64, sft_lr=1e-3, sft_tool_share=0.35, eval_limit=200, eval_batch_size=100)
TOOLS_QUICK = dict(sft_steps=10, eval_limit=20, grpo_steps=3, grpo_eval_steps=3, grpo_eval_limit=10)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = ArgumentParser(  # dashes or underscores, no abbreviations, one-line errors (common/settings/argparser.py)
        prog="./launch.sh demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="R1-Zero/R1 in miniature: tiny model -> cold-start SFT -> eval -> GRPO (ref server + "
                    "genonly worker + deepspeed ranks) -> eval, with summary.json and plot.png in the run "
                    "directory. Arguments after `--` go to the trainer (e.g. -- --lr 5e-5 --all_steps 100).",
        epilog=__doc__.split("Default (CPU", 1)[0].strip())
    p.add_argument("--run-dir", default=None, help="Output directory (default runs/demo-<timestamp>; relative paths, "
                                                    "here and in --config/--model/--data, from where you run it).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the model init, SFT and GRPO (default 0).")
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized run: {QUICK['sft_steps']} SFT steps, {QUICK['grpo_steps']} GRPO steps of "
                        f"{QUICK['grpo_groups']} group a rank, {QUICK['eval_limit']} eval examples (checks the "
                        "plumbing, not the learning).")
    p.add_argument("--tools", action="store_true",
                   help="The tool demo (issue 32): ab*cd+e with the built-in calculator; SFT on traces with and "
                        "without a call, GRPO with multi-turn rollouts (configs/demo_tools.json); summary.json adds "
                        "tool_calls_per_completion_before/_after and accuracy_without_tools. Tiny model only.")
    p.add_argument("--agent", action="store_true",
                   help="The agent demo (issue 61): the tool demo's task and SFT, with the openai-SDK agent "
                        "examples/agents/calculator_agent.py as the rollout (configs/demo_agent.json); before/after "
                        "accuracy of that agent against the endpoint. Tiny model only.")
    p.add_argument("--sft-tool-share", type=float, default=None,
                   help=f"--tools: share of SFT traces that call the calculator (default "
                        f"{TOOLS['sft_tool_share']}); the rest compute by themselves.")
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
    p.add_argument("--sft-batch-size", type=int, default=None,
                   help=f"default {DEFAULTS['sft_batch_size']} ({TOOLS['sft_batch_size']} with --tools)")
    p.add_argument("--sft-lr", type=float, default=None,
                   help=f"default {DEFAULTS['sft_lr']} ({TOOLS['sft_lr']} with --tools)")
    p.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the config's all_steps).")
    p.add_argument("--eval-limit", type=int, default=None,
                   help=f"Held-out examples in the before/after evaluation (default {DEFAULTS['eval_limit']} "
                        f"for the tiny demo, the config's eval_limit with --model).")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help=f"Sequences per generate call in evaluation (default {DEFAULTS['eval_batch_size']} for the "
                        f"tiny demo, the config's gen_batch_size with --model).")
    p.add_argument("--workers", type=int, default=1, help="genonly workers (default 1).")
    p.add_argument("--gpus", type=int, default=None, help="Trainer ranks (default: all GPUs on CUDA; on CPU 1 "
                   "or 2 as launch.sh's plan measures, common/placement/cpu_ranks.py).")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of this process for SFT/eval on CPU (the ranks use 1 each). Default: "
                        "2 when the machine is idle (1-min load average < 1), else 1 - on busy cores a 2-thread "
                        "OpenMP step measured 3x the CPU time of a 1-thread one.")
    a = p.parse_args(argv)
    a.tiny = a.model is None
    if a.agent and a.tools:
        p.error("--agent and --tools are two demos (the agent brings its own calculator): give one")
    tooled = a.tools or a.agent  # the agent demo has the tool demo's task, SFT and sizes
    if tooled and not a.tiny:
        p.error(f"{'--agent' if a.agent else '--tools'} runs a tiny demo: it takes no --model (give a real run "
                f"`{'agent' if a.agent else 'tools'}` in its config)")
    if a.tiny and a.data not in (None, "arith_tools" if tooled else "arith"):
        p.error("--data needs --model (the tiny demo trains on its built-in task)")
    if tooled and a.sft_target is not None:
        p.error("--sft-target is the plain demo's stopping rule; --tools and --agent run --sft-steps steps")
    own = {**DEFAULTS, **TOOLS} if tooled else DEFAULTS
    quick = {**QUICK, **TOOLS_QUICK} if tooled else QUICK
    if a.tiny:
        a.data = "arith_tools" if tooled else "arith"
    if a.sft_steps is None:
        a.sft_steps = (quick if a.quick else own)["sft_steps"] if a.tiny else 0
    if a.sft_target is None:
        a.sft_target = DEFAULTS["sft_target"] if a.tiny and not a.quick and not tooled else 0.0
    a.sft_batch_size = own["sft_batch_size"] if a.sft_batch_size is None else a.sft_batch_size
    a.sft_lr = own["sft_lr"] if a.sft_lr is None else a.sft_lr
    a.sft_tool_share = TOOLS["sft_tool_share"] if a.sft_tool_share is None else a.sft_tool_share
    if not 0.0 <= a.sft_tool_share <= 1.0:
        p.error(f"--sft-tool-share must be within [0, 1], got {a.sft_tool_share}")
    a.own, a.quick_sizes = own, quick
    if a.config is None and a.tiny:
        a.config = str(AGENT_CONFIG if a.agent else TOOLS_CONFIG if a.tools else DEMO_CONFIG)
    # paths are the caller's, as for `launch.sh train` (launch.sh runs this from the checkout)
    a.run_dir = caller_path(a.run_dir or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}")
    a.config = caller_path(a.config)
    for name in ("model", "data"):  # a hub id stays one; a path that names something at the caller is taken there
        value = getattr(a, name)
        if value is not None and (value.startswith(("./", "../")) or os.path.exists(caller_path(value))):
            setattr(a, name, caller_path(value))
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
    from common.settings.gen_defaults import on_cuda, resolve_generation
    from common.settings.knobs import load_config_or_exit
    from trainer.run.metrics import read_metrics

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if a.threads is None:
            a.threads = min(2, os.cpu_count() or 1) if os.getloadavg()[0] < 1.0 else 1
        torch.set_num_threads(a.threads)
    device = "auto"

    # The trainer config: file <- --model/--data <- demo overrides <- what the user put after `--`.
    trainer_args: list[str] = ["--config", a.config] if a.config else []
    if not a.tiny:
        trainer_args += ["--model", a.model]
    if a.data:
        trainer_args += ["--data", a.data]
    trainer_args += ["--seed", str(a.seed)]
    if a.agent:  # the example in the checkout, whatever folder the demo runs from
        trainer_args += ["--agent", AGENT_SPEC]
    if a.quick:
        q = a.quick_sizes
        trainer_args += ["--all_steps", str(q["grpo_steps"]), "--Q_batch_size", str(q["grpo_prompts"]),
                         "--train_batch_groups", str(q["grpo_groups"])]
        if not a.agent:  # in-training evaluation does not run an agent (refused with `agent`)
            trainer_args += ["--eval_steps", str(q["grpo_eval_steps"]), "--eval_limit", str(q["grpo_eval_limit"])]
    if a.grpo_steps is not None:
        trainer_args += ["--all_steps", str(a.grpo_steps)]
    trainer_args += ["--eval_before", "false"]  # this script evaluates before and after itself
    cfg = load_config_or_exit(GRPOConfig, trainer_args + extra, prog="./launch.sh demo --")
    a.data = cfg.data
    gen_bs = cfg.gen_batch_size if cfg.gen_batch_size != "auto" else \
        resolve_generation(cfg, cuda=on_cuda(cfg.device))[0].gen_batch_size  # this device's, as the run's
    eval_bs = a.eval_batch_size or (a.own["eval_batch_size"] if a.tiny else gen_bs)
    eval_limit = a.eval_limit or ((a.quick_sizes if a.quick else a.own)["eval_limit"] if a.tiny else cfg.eval_limit)

    log.banner(f"{'An agent' if a.agent else 'Tool use' if a.tools else 'R1'} in miniature: run dir {run_dir}")
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
    if a.sft_steps > 0 and (a.tools or a.agent):
        model_dir = tool_cold_start_sft(a, sft_config(cfg) if a.agent else cfg, model_dir, run_dir, log, device)
    elif a.sft_steps > 0:
        model_dir = cold_start_sft(a, cfg, model_dir, run_dir, log, device, eval_bs,
                                   check={"from": DEFAULTS["sft_check_from"], "every": DEFAULTS["sft_check_every"],
                                          "dev": DEFAULTS["sft_dev"]})
    else:
        log.banner("2/5 cold-start SFT: skipped")
    timings["sft_s"] = round(time.time() - t0, 1)

    # 3. eval before ----------------------------------------------------------------------------
    t0 = time.time()
    log.banner(f"3/5 held-out evaluation before GRPO ({cfg.eval_split} split, {eval_limit} examples, greedy)")
    without = None
    if a.agent:
        before = run_agent_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
        log(f"the agent (greedy, against the endpoint): accuracy {100 * before['accuracy']:.1f}%   calls per "
            f"rollout {before['calls_per_rollout']:.2f}   ({before['seconds']:.0f} s)")
        show_agent_samples(log, before)
    elif a.tools:
        before = run_tool_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device, with_tools=True)
        log(f"with the calculator: accuracy {100 * before['accuracy']:.1f}%   tool calls per completion "
            f"{before['tool_calls_per_completion']:.2f}   ({before['seconds']:.0f} s)")
        show_tool_samples(log, before)
        without = run_tool_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device, with_tools=False)
        log(f"without tools:       accuracy {100 * without['accuracy']:.1f}%   ({without['seconds']:.0f} s)")
    else:
        before = run_eval(model_dir, a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
        log(f"accuracy {100 * before['accuracy']:.1f}%   format {100 * before['format_rate']:.1f}%   "
            f"({before['seconds']:.0f} s)")
        show_samples(log, before)
    timings["eval_before_s"] = round(time.time() - t0, 1)

    # 4. GRPO -------------------------------------------------------------------------------------
    t0 = time.time()
    grpo_dir = run_dir / "grpo"
    log.banner(f"4/5 GRPO: {cfg.all_steps} steps, ref server + {a.workers} genonly worker(s) + deepspeed "
               f"x{a.gpus or ('all GPUs' if on_gpu else 'auto ranks')} (logs in {grpo_dir})")
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
    if a.agent:
        after = run_agent_eval(str(final_dir), a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
        show_agent_samples(log, after)
    elif a.tools:
        after = run_tool_eval(str(final_dir), a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device,
                              with_tools=True)
        show_tool_samples(log, after)
    else:
        after = run_eval(str(final_dir), a.data, cfg.eval_split, eval_limit, cfg, eval_bs, device)
        show_samples(log, after)
    timings["eval_after_s"] = round(time.time() - t0, 1)
    wall = time.time() - t_start

    report(a, cfg, before, after, metrics, timings, wall, run_dir, grpo_dir, log, without=without, agent=a.agent)
    return 0


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def run() -> None:
    """`python -m trainer.demo`: main() with Ctrl-C as exit 130."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[demo] interrupted", file=sys.stderr)
        sys.exit(130)
