"""The tool demo's own phases (`./launch.sh demo --tools`; cli.py runs them in the demo's order): the cold-start SFT
on traces with and without `calculator` calls, the held-out evaluation with the tools (multi-turn) and without
them, and the summary's tool figures. The GRPO phase is the demo's own (phases.run_training) with
configs/demo_tools.json, whose `tools` make every rollout multi-turn."""
from __future__ import annotations

import time
from pathlib import Path

from trainer.demo.phases import DEV_HOLDOUT, Log, _free_cuda, _system_prompt
from trainer.demo.tool_task import is_correct


def tool_cold_start_sft(a, cfg, model_dir: str, run_dir: Path, log: Log, device: str) -> str:
    """SFT on a mix of traces: with probability a.sft_tool_share the calculator trace, else the worked solution by
    itself (tool_sft.py); a.sft_steps steps. Returns the saved model's directory."""
    from common.modeling import load_model, load_tokenizer
    from trainer.data.loading import load_examples
    from trainer.demo.sft import sft_pairs
    from trainer.demo.tool_sft import sft_pairs_for
    from trainer.tools import ToolBox

    t0 = time.time()
    log.banner(f"2/5 cold-start SFT: {a.sft_steps} steps x {a.sft_batch_size} traces, lr {a.sft_lr}, "
               f"{100 * a.sft_tool_share:.0f}% of them calling the {', '.join(cfg.tools)}")
    # the train split less the rows the plain demo keeps for its SFT check (same layout), at most what SFT can see
    rows = load_examples(a.data, split=cfg.data_split, limit=cfg.data_limit)[DEV_HOLDOUT:]
    rows = rows[:a.sft_steps * a.sft_batch_size]
    tok = load_tokenizer(model_dir, cfg.load_options())
    toolbox = ToolBox.from_config(cfg, tok)
    try:
        pairs = sft_pairs_for(tok, toolbox, rows, a.sft_tool_share, a.seed, _system_prompt(cfg.system_prompt))
    finally:
        toolbox.close()
    model = load_model(model_dir, device=device, dtype="float32", trainable=True, options=cfg.load_options())

    def on_step(i: int, loss: float) -> bool:
        if i % 25 == 0 or i == a.sft_steps:
            log(f"  SFT step {i}/{a.sft_steps}  loss {loss:.3f}  ({time.time() - t0:.0f} s)")
        return False

    losses = sft_pairs(model, tok, pairs, steps=a.sft_steps, batch_size=a.sft_batch_size, lr=a.sft_lr, seed=a.seed,
                       progress=False, on_step=on_step)
    sft_dir = run_dir / "sft"
    model.save_pretrained(sft_dir, safe_serialization=True)
    tok.save_pretrained(sft_dir)
    del model
    _free_cuda()
    log(f"SFT {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - t0:.0f} s; "
        f"saved to {sft_dir}")
    return str(sft_dir)


def run_tool_eval(model_dir: str, data: str, split: str, limit: int, cfg, batch_size: int, device: str,
                  with_tools: bool) -> dict:
    """Greedy held-out accuracy with the config's tools (multi-turn, as rollouts) or without any (single turn: the
    model's own arithmetic; a call it makes then goes unanswered). Accuracy is the demo's reward: the last
    <answer> must hold the value (a number elsewhere, such as the tool's own output, never counts)."""
    from dataclasses import replace

    from common.modeling import load_model, load_tokenizer
    from trainer.data import run_data
    from trainer.evaluate import evaluate
    from trainer.tools import ToolBox

    examples = run_data.eval_examples(replace(cfg, data=data, eval_split=split, eval_limit=limit, eval_before=True))
    tok = load_tokenizer(model_dir, cfg.load_options())
    model = load_model(model_dir, device=device, dtype="auto", options=cfg.load_options())
    toolbox = ToolBox.from_config(cfg, tok) if with_tools else None
    try:
        res = evaluate(model, tok, examples, system_prompt=cfg.system_prompt,
                       max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                       max_prompt_length=cfg.max_prompt_length, batch_size=batch_size, num_samples=len(examples),
                       progress=False, toolbox=toolbox, max_tool_calling_iterations=cfg.max_tool_calling_iterations)
    finally:
        if toolbox is not None:
            toolbox.close()
    del model
    _free_cuda()
    ok = [is_correct(s["completion"], s["ground_truth"]) for s in res["samples"]]
    called = ["<tool_call>" in s["completion"] for s in res["samples"]]
    if len(ok) != res["n"]:
        raise RuntimeError(f"evaluation returned {len(ok)} samples for {res['n']} examples")
    res["accuracy"] = sum(ok) / max(len(ok), 1)
    res.setdefault("tool_calls_per_completion", 0.0)  # without tools nothing is called
    # how the answers split: with a call (and its result) or by itself
    res["accuracy_with_call"] = sum(o for o, c in zip(ok, called) if c) / max(sum(called), 1)
    res["accuracy_own"] = sum(o for o, c in zip(ok, called) if not c) / max(len(ok) - sum(called), 1)
    return res


def show_tool_samples(log: Log, res: dict, n: int = 3) -> None:
    for s in res.get("samples", [])[:n]:
        ok = is_correct(s["completion"], s["ground_truth"])
        log(f"  [{'ok ' if ok else 'bad'}] {s['prompt']!r:>10} -> {s['completion'][:120]!r} "
            f"(answer {s['ground_truth']})")
