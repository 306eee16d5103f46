"""Greedy pass@1 accuracy and format rate of a model on held-out data, scored with the run's rewards.

    python -m trainer.evaluate --model DIR --data ../shared/data/gsm8k --split test --limit 200 --out eval.json
    python -m trainer.evaluate --model runs/x/final --data held_out.jsonl --config my_config.json

A single data file is evaluated whole (it has no splits: `--split` on one is an error, so that the training rows
are never reported as a test split); a dataset with splits needs `--split`.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import GRPOConfig
from common.gc_pause import imports_without_gc
from common.settings.argparser import ArgumentParser
from common.settings.knobs import load_config, parse_bool, parse_dict

if TYPE_CHECKING:
    from trainer.data.loading import Example
# torch, transformers, the engines and rewards are imported where they are used: `python -m trainer.evaluate --help`,
# a bad flag or a --split refusal answer at once (they cost ~5.5 CPU-s of imports before the arguments were read)

log = logging.getLogger("trainer")
CORRECTNESS_REWARDS = ("correct", "math_verify", "countdown")  # built-ins whose > 0 means "solved"


def _one_line(e: Exception) -> str:
    """A reward failure in one line: which function, and the error it raised (not the reward process's traceback)."""
    text = str(e)
    head = text.split("\n")[0].split("Traceback")[0].strip()
    errors = re.findall(r"\b\w+(?:Error|Exception): [^\n]*", text)
    return f"{head} {errors[-1].strip()}" if errors else " ".join(text.split())


def _no_grad(fn):
    """torch.no_grad(), with torch imported at the call (see the imports above)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


@_no_grad
def evaluate(model, tokenizer, examples: list[Example], *, system_prompt: str | None = "default",
             max_new_tokens: int = 512, max_prompt_length: int = 4096, batch_size: int = 32,
             num_samples: int = 20, progress: bool = True, prompt_format: str = "auto", scorer=None,
             toolbox=None, max_tool_calling_iterations: int | None = None,
             chat_template_kwargs: dict | None = None) -> dict:
    """Greedy decode every example; accuracy = share with reward_correct > 0, format = reward_format > 0.
    With `scorer` (the run's RewardScorer: in-training eval) the completions are scored with the run's reward
    functions instead: "rewards" {name: [sum, completions it applied to, completions it scored > 0]} and
    "reward_total" (the weighted sums' total); the built-in correct/format are not called (a prompt-only
    dataset has no ground truth for them).

    `model` is an HF model (wrapped in the HF engine) or any GenEngine (e.g. vLLM); greedy decoding
    ignores the checkpoint's generation_config (no repetition_penalty) either way.
    toolbox (trainer/tools): the model may call tools (multi-turn, trainer/tools/multi_turn.py; the prompt lists them);
    "tool_calls" counts them and each sample shows its turns. Without one: single-turn, the accuracy without
    tools."""
    from tqdm import tqdm

    from common.modeling import eos_ids
    from trainer.dist.comm import all_reduce_int
    from trainer.engines import GenEngine
    from trainer.engines.hf import HFEngine
    from trainer.rewards.builtin import reward_correct, reward_format
    from trainer.rollout import encode_prompts, sample_groups, started_prompts
    t0 = time.time()
    # a tool run renders with TRL's training chat template where it swaps one in (ToolBox.template_kwargs)
    render_kw = {**(chat_template_kwargs or {}), **(toolbox.template_kwargs if toolbox is not None else {})}
    kept, skipped = encode_prompts(tokenizer, examples, system_prompt, max_prompt_length, prompt_format,
                                   toolbox.prompt_tools if toolbox is not None else None, render_kw)
    engine = model if isinstance(model, GenEngine) else \
        HFEngine(model, tokenizer, eos_ids(tokenizer, model, chat=prompt_format != "r1zero"), temperature=1.0,
                 top_p=1.0, top_k=0, gen_batch_size=batch_size)
    correct = formatted = 0
    rewards: dict[str, list] = {}
    reward_total, reward_errors = 0.0, 0
    samples, tool_calls = [], 0
    bar = tqdm(total=len(kept), desc="eval", disable=not progress, leave=False)
    calls = math.ceil(len(kept) / batch_size)
    if getattr(engine, "synced_gpus", False):  # ZeRO-3 ranks evaluating their shards together: as many calls
        calls = all_reduce_int(calls, "max")
    for c in range(calls):
        chunk = kept[c * batch_size:(c + 1) * batch_size]
        outs, messages, stats = sample_groups(engine, tokenizer, chunk, 1, max_new_tokens, toolbox=toolbox,
                                              max_iterations=max_tool_calling_iterations, greedy=True,
                                              system_prompt=system_prompt, prompt_format=prompt_format,
                                              template_kwargs=render_kw,
                                              snapshots=getattr(scorer, "wants_environments", False))
        tool_calls += sum(int(s["calls"]) for s in stats or [])
        for k, ((ex, _), out) in enumerate(zip(chunk, outs)):
            text = tokenizer.decode(out.completion_ids, skip_special_tokens=True)
            conv = [messages[k]] if messages is not None else None
            if scorer is not None:
                ids = [int(t) for t in out.completion_ids]  # plain ints: they go to the reward process as JSON
                try:
                    score = scorer.score_group(ex, [text], [ids], conv,
                                               [stats[k].get("env_rewards")] if stats is not None else None,
                                               [stats[k].get("environment")] if stats is not None else None,
                                               started_prompts([ex], stats[k:k + 1] if stats is not None else None))
                except RuntimeError as e:  # e.g. a TRL reward reading a column the held-out rows lack: eval
                    # must not end the run; counted (eval_reward_errors) and said, once per eval
                    if not reward_errors:
                        log.warning("eval: a reward failed on a held-out example, which is left unscored (more "
                                    "are counted in eval_reward_errors): %s", _one_line(e))
                    reward_errors += 1
                    continue
                reward_total += score.rewards[0] if score.rewards[0] == score.rewards[0] else 0.0  # NaN: unscored
                for name, (v,) in score.components.items():
                    acc = rewards.setdefault(name, [0.0, 0, 0])
                    if v is not None:
                        acc[0], acc[1], acc[2] = acc[0] + v, acc[1] + 1, acc[2] + (v > 0)
                ok = fmt = None
            else:
                ok, fmt = reward_correct(text, ex.ground_truth) > 0, reward_format(text) > 0
                correct += ok
                formatted += fmt
            if len(samples) < num_samples:
                samples.append({"prompt": ex.prompt, "ground_truth": ex.ground_truth, "completion": text,
                                "correct": ok, "format": fmt, **({"messages": conv[0]} if conv else {})})
        bar.update(len(chunk))
    bar.close()
    n = max(len(kept), 1)
    # the counts too: ranks that evaluated shards sum them (trainer/loop.py run_eval), exactly
    return {"accuracy": correct / n, "format_rate": formatted / n, "n": len(kept), "correct": int(correct),
            "formatted": int(formatted), "skipped_long_prompt": skipped, "seconds": round(time.time() - t0, 2),
            "samples": samples, "rewards": rewards, "reward_total": reward_total, "reward_errors": reward_errors,
            **({"tool_calls": tool_calls, "tool_calls_per_completion": tool_calls / n} if toolbox is not None else {})}


def generation_defaults(a, run_cfg: GRPOConfig) -> None:
    """The options not given take the run's settings (GRPOConfig's defaults without --config, the same values as
    before): eval_max_new_tokens else max_new_tokens (TRL's max_completion_length), as in-training eval does."""
    if a.max_new_tokens is None:
        a.max_new_tokens = run_cfg.eval_max_new_tokens or run_cfg.max_new_tokens
    for name in ("system_prompt", "prompt_format", "chat_template_kwargs"):
        if getattr(a, name) is None:
            setattr(a, name, getattr(run_cfg, name))


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m trainer.evaluate", description="Greedy pass@1 accuracy and format rate "
                                                                      "(GSM8K test split or any JSONL of {prompt, "
                                                                      "ground_truth}).")
    p.add_argument("--model", required=True, help="HF model directory or id ('tiny' = embedded default).")
    p.add_argument("--data", default="openai/gsm8k", help="Hub id, directory with {split}.jsonl, or a file.")
    p.add_argument("--split", default=None, help="Split of a dataset with splits (a hub id, a folder with "
                                                 "{split}.jsonl, arith): needed there. A single file has none: it "
                                                 "is evaluated whole, so give held-out rows as their own file.")
    p.add_argument("--config", default=None, help="The run's config JSON: its reward_fns, reward_weights and "
                                                  "reward_timeout score the completions (as eval_data does in "
                                                  "training), and its generation settings are the defaults of the "
                                                  "four below: eval_max_new_tokens (else max_new_tokens / TRL's "
                                                  "max_completion_length), system_prompt, prompt_format, "
                                                  "chat_template_kwargs.")
    p.add_argument("--reward-fns", default=None, help="Reward functions to score with, as the trainer's "
                                                      "reward_fns (default: the --config's, else correct,format).")
    p.add_argument("--limit", type=int, default=None, help="Evaluate only the first N examples.")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the --config's, else 512")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--system-prompt", default=None, help="'default' (R1-style), '' (none) or a text (default: the "
                                                       "--config's, else 'default').")
    p.add_argument("--prompt-format", default=None, help="auto, chat, messages, raw, r1zero or trl "
                                                         "(trainer/data/prompt_formats.py; default: the --config's, "
                                                         "else auto).")
    p.add_argument("--chat-template-kwargs", type=parse_dict, default=None, help="More chat template arguments (a "
                                                                                 "JSON object, e.g. Qwen3's "
                                                                                 "'{\"enable_thinking\": false}').")
    p.add_argument("--dataset-config", default=None, help="Configuration (subset) of a hub dataset or dataset folder.")
    p.add_argument("--prompt-column", default=None, help="Dataset column of the prompt (default: detected).")
    p.add_argument("--answer-column", default=None, help="Dataset column(s) of the answer (default: detected).")
    p.add_argument("--prompt-template", default=None, help="str.format template over the row's columns.")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    p.add_argument("--gen-backend", default="hf", choices=["hf", "vllm"], help="Generation engine.")
    p.add_argument("--vllm-dtype", default="auto", help="vLLM dtype (auto, bfloat16, float16, float32).")
    p.add_argument("--tools", default="", help="Tools the model may call (comma-separated: calculator, python, "
                                                "module:function, file.py:function); '' (default) = none: the "
                                                "accuracy without tools.")
    p.add_argument("--environment-factory", default=None, help="TRL's environment_factory: a class whose public "
                                                               "methods are tools, one instance per example.")
    p.add_argument("--max-tool-calling-iterations", type=int, default=None, help="Tool rounds per completion at "
                                                                                "most (default: no limit).")
    p.add_argument("--tool-timeout", type=float, default=10.0, help="Seconds one tool call may take.")
    p.add_argument("--out", default=None, help="Write the JSON summary (with sample completions) here.")
    # how the model loads: the trainer's options of the same names (common/settings/model_options.py)
    p.add_argument("--trust-remote-code", type=parse_bool, default=False, help="Allow the checkpoint's own code.")
    p.add_argument("--attn-implementation", default=None, help="from_pretrained attention kernel (eager, sdpa...).")
    p.add_argument("--revision", default=None, help="Hub revision of the model and its tokenizer.")
    p.add_argument("--model-init-kwargs", type=parse_dict, default=None, help="More from_pretrained arguments "
                                                                              "(a JSON object).")
    a = p.parse_args(argv)
    a.split = _split(p, a.data, a.split)
    with imports_without_gc():  # torch and transformers (common/gc_pause.py)
        from common.modeling import load_model, load_tokenizer, resolve_model_path
        from trainer.data.loading import ColumnSpec, load_examples
        from trainer.engines import make_engine
        from trainer.rewards.scoring import RewardScorer
        from trainer.tools import ToolBox
    run_cfg = load_config(GRPOConfig, ["--config", a.config]) if a.config else GRPOConfig()
    generation_defaults(a, run_cfg)
    specs = a.reward_fns or run_cfg.reward_specs()  # reward_fns null: the built-ins (or an environment's)
    path = resolve_model_path(a.model)
    cfg = GRPOConfig(model=path, gen_backend=a.gen_backend, vllm_dtype=a.vllm_dtype, max_new_tokens=a.max_new_tokens,
                     max_prompt_length=4096, device=a.device, prompt_format=a.prompt_format,
                     trust_remote_code=a.trust_remote_code, attn_implementation=a.attn_implementation,
                     revision=a.revision, model_init_kwargs=a.model_init_kwargs,
                     tools=[t.strip() for t in a.tools.split(",") if t.strip()],
                     environment_factory=a.environment_factory or None,
                     max_tool_calling_iterations=a.max_tool_calling_iterations, tool_timeout=a.tool_timeout,
                     chat_template_kwargs=a.chat_template_kwargs or {}).validate()  # the tool turns' renders too
    tok = load_tokenizer(path, cfg.load_options())
    toolbox = ToolBox.from_config(cfg, tok)  # None: no tools
    if a.gen_backend == "vllm":
        model = make_engine(cfg, path, tokenizer=tok)
    else:
        model = load_model(path, device=a.device, dtype=a.dtype, options=cfg.load_options())
    columns = ColumnSpec(a.prompt_column, a.answer_column, a.prompt_template, a.prompt_format)
    examples = load_examples(a.data, split=a.split or "test", limit=a.limit, columns=columns,
                             config=a.dataset_config)  # (a single file: the split is not read)
    scorer = RewardScorer(specs, None if a.reward_fns else run_cfg.reward_weights,
                          run_cfg.reward_timeout, {"messages": True, "auto": None}.get(a.prompt_format, False))
    try:
        res = evaluate(model, tok, examples, system_prompt=a.system_prompt, max_new_tokens=a.max_new_tokens,
                       batch_size=a.batch_size, prompt_format=a.prompt_format, toolbox=toolbox,
                       max_tool_calling_iterations=a.max_tool_calling_iterations, scorer=scorer,
                       chat_template_kwargs=a.chat_template_kwargs)
    finally:
        scorer.close()
        if toolbox is not None:
            toolbox.close()
    res.update(model=a.model, data=a.data, split=a.split, reward_fns=scorer.names, **by_reward(res, scorer.names),
               max_new_tokens=a.max_new_tokens, system_prompt=a.system_prompt, prompt_format=a.prompt_format)
    calls = f"  tool calls per completion {res['tool_calls_per_completion']:.2f}" if toolbox is not None else ""
    shown = lambda k: "n/a" if res[k] is None else f"{res[k]:.4f}"  # n/a: no correctness / format reward
    means = "  ".join(f"{k} {v:.4f}" for k, v in res.items() if k.startswith("reward/"))
    print(f"accuracy {shown('accuracy')}  format {shown('format_rate')}  {means}  n={res['n']}{calls}  "
          f"({res['seconds']} s)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
        print(f"summary written to {a.out}")
    return res


def _split(p, data: str, split: str | None) -> str | None:
    """A single file has no splits: --split there would report the training rows as a test split. A source with
    splits needs one named."""
    if Path(data).is_file():
        if split is not None:
            p.error(f"--split {split}: {data} is a single file, which has no splits (every row would be evaluated, "
                    f"the training rows too). Give the held-out rows as a file of their own: --data held_out.jsonl "
                    f"here, and eval_data in training (docs/evaluation.md)")
        return None
    if split is None:
        p.error(f"--split: {data} is a dataset with splits; name the held-out one (e.g. --split test)")
    return split


def by_reward(res: dict, names: list[str]) -> dict:
    """accuracy / format_rate from the run's rewards (a correctness reward's / `format`'s share of completions
    scored > 0; None without one), and each reward's mean where it applied (reward/<name>)."""
    n, scored = max(res["n"], 1), res["rewards"]
    hits = lambda name: scored.get(name, [0.0, 0, 0])[2] / n
    right = next((name for name in names if name in CORRECTNESS_REWARDS), None)
    out = {"accuracy": hits(right) if right else None, "format_rate": hits("format") if "format" in names else None,
           "correct": scored.get(right, [0, 0, 0])[2] if right else None,
           "formatted": scored.get("format", [0, 0, 0])[2] if "format" in names else None}
    out.update({f"reward/{k}": v[0] / v[1] for k, v in scored.items() if v[1]})
    return out


if __name__ == "__main__":
    main()
    if "vllm" not in sys.modules:  # closed: skip the teardown (common/fast_exit.py); vLLM's engine: its own shutdown
        from common.fast_exit import exit_cleanly
        exit_cleanly(0)
