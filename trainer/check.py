"""Find in seconds what would fail in minutes: `./launch.sh check [launch.sh options] -- [trainer args]`, and the
checks `./launch.sh train` runs before it starts anything. No model weights are loaded (but for `agent`).

One line per check, `ok` or `FAIL` with what is wrong; exit 1 when any fails:
    config   the trainer's config parses and validates (TRL names included)
    model    config.json and the tokenizer load from the path, hub id or local cache
    data     every row (up to CHECK_ROWS) goes through the column mapping, the first through the prompt format
             (the first prompt is printed as the model will see it, template and all)
    rewards  every reward function imports as the workers import it (common/user_code.py) and scores a whole group
             (num_generations completions) of each of the first rows, as training does
    agent    with `agent`, in place of `rewards`: the agent once on the first row against the real endpoint (the
             model's weights loaded), its conversation and token counts printed, its rollout scored
             (trainer/check_agent.py)
    tools    with tools/environment_factory: each tool imports and has a JSON schema (one line per tool), and the
             chat template shows them to the model: which family parses the calls, which chat template the
             run renders with (TRL's training template where TRL swaps one in), refused where TRL refuses
             (trainer/check_tools.py)
    port     the ref server's port is free (when launch.sh starts the server)
    disk     the run directory's filesystem has room for checkpoints: at least twice the model's size
The placement plan is checked by launch.sh itself (common/placement/launch_plan.py), before these.

    python -m trainer.check [--port P] [--run-dir D] [--ref-url URL] -- [trainer args]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common.config import GRPOConfig
from common.placement.gen_choice import backend_words
from common.settings.knobs import load_config

ANSWER = "<think>\nLet me work it out.\n</think>\n<answer>\n{}\n</answer>"  # a well-formed completion to score


class Checker:
    def __init__(self):
        self.failed: list[str] = []
        self.cfg: GRPOConfig | None = None
        self.model_path: str | None = None
        self.tokenizer = None
        self.examples: list = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        t0, more = time.time(), []
        try:
            detail = fn()
        except SystemExit as e:  # argparse / load_config say what is wrong themselves, then exit
            detail, ok = f"invalid arguments (exit {e.code})", False
        except Exception as e:  # every check reports its own failure in one line, and the others still run
            first, *more = str(e).strip().splitlines() or [""]  # details (a reward's row, completion) below it
            detail, ok = " ".join(f"{type(e).__name__}: {first}".split()), False
            self.failed.append(name)
        else:
            ok = True
        print(f"{'ok  ' if ok else 'FAIL'} {name:<8} {detail} ({time.time() - t0:.1f} s)", flush=True)
        for line in more:
            print(f"     | {line}", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.failed.append(name)
        print(f"FAIL {name:<8} not checked: {why}", flush=True)


def check_config(c: Checker, argv: list[str]) -> str:
    c.cfg = load_config(GRPOConfig, argv, prog="launch.sh check --")
    if c.cfg.gen_backend == "vllm":  # TRL's use_vllm maps here: the workers would fail to start without it
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("gen_backend vllm (TRL: use_vllm true) but vLLM is not installed in this environment")
    specs = c.cfg.reward_specs() + [f"{n} (get_reward)" for n in c.cfg.env_reward_names()] + [
        f"{n} (the agent's own)" for n in c.cfg.agent_reward_names()]
    return f"model {c.cfg.model}, data {c.cfg.data}, rewards {','.join(map(str, specs))}, workers " \
           f"generate with {backend_words(c.cfg)}"


def check_model(c: Checker) -> str:
    from common.modeling import load_model_config, load_tokenizer, resolve_model_path
    path = resolve_model_path(c.cfg.model)
    conf = load_model_config(path, c.cfg.load_options())  # as every process loads it: revision, remote code
    c.tokenizer = load_tokenizer(path, c.cfg.load_options())
    c.model_path = path  # the disk check sizes it
    return (f"{type(conf).__name__}: {conf.num_hidden_layers} layers, hidden {conf.hidden_size}, vocab "
            f"{conf.vocab_size}; tokenizer {len(c.tokenizer)} tokens, eos {c.tokenizer.eos_token!r}, "
            f"pad {c.tokenizer.pad_token!r}")


def check_data(c: Checker) -> str:
    from trainer.data import run_data
    from trainer.rollout import encode_prompts
    cfg = c.cfg
    every = run_data.train_examples(cfg, limit=min(cfg.data_limit or run_data.CHECK_ROWS, run_data.CHECK_ROWS))
    c.examples, held_out = every[:3], run_data.eval_examples(cfg, limit=3)  # every row read as the ranks read it
    read = f"{len(every)} rows read{' (CHECK_ROWS)' * (len(every) == run_data.CHECK_ROWS)}, prompt format " + (
        f"{cfg.prompt_format}; eval rows from {cfg.eval_data or cfg.data} ({cfg.eval_split})" if held_out else
        f"{cfg.prompt_format}")
    if c.tokenizer is None:
        return read + " (prompts not rendered: no tokenizer)"
    # counted as the model sees them: chat template, the tools section, what an environment's reset() adds
    examples, schemas, render_kw = _as_generated(c)
    system = None if cfg.agent else cfg.system_prompt  # an agent owns its prompt (counted so in rollouts too)
    kept, _ = encode_prompts(c.tokenizer, examples, system, sys.maxsize, cfg.prompt_format, schemas,
                             template_kwargs=render_kw)
    over = [(row, len(ids)) for row, (_, ids) in enumerate(kept) if len(ids) > cfg.max_prompt_length]
    if over:
        rows = ", ".join(f"row {row}: {n} tokens" for row, n in over)
        raise ValueError(f"{len(over)} of the first {len(kept)} prompts do not fit max_prompt_length "
                         f"{cfg.max_prompt_length} as the model sees them ({rows}; chat template"
                         f"{', tools section' if schemas else ''} included): raise max_prompt_length or shorten "
                         f"them (training would skip them)")
    ex, ids = kept[0]
    print(f"     first prompt as the model sees it ({len(ids)} tokens; ground truth {ex.ground_truth!r}):")
    print("\n".join("     | " + line for line in c.tokenizer.decode(ids).splitlines()))
    return read + f", longest prompt {max(len(i) for _, i in kept)} of max_prompt_length {cfg.max_prompt_length} tokens"


def _as_generated(c: Checker) -> tuple[list, object, dict]:
    """The first rows as rollouts start from them, the tools (ToolBox.prompt_tools: a row -> its schemas) and the
    render arguments (a tool run's: TRL's training chat template where it swaps one in): with environment_factory,
    each row's reset() text appended (trainer/rollout.py with_observation), as TRL does."""
    from trainer.rollout import reset_kwargs, with_observation
    from trainer.tools import ToolBox
    try:
        box = ToolBox.from_config(c.cfg, c.tokenizer)
    except (ValueError, ImportError):  # a tool that does not load: its own `tools` line says why, once
        return c.examples, None, c.cfg.chat_template_kwargs
    if box is None:
        return c.examples, None, c.cfg.chat_template_kwargs
    try:
        if not box.has_env:
            return c.examples, box.prompt_tools, box.template_kwargs
        ids = box.start_episodes(len(c.examples), [reset_kwargs(ex) for ex in c.examples])
        obs = [box.observations.get(i) for i in ids]
        box.end_episodes(ids)
        return ([ex if o is None else with_observation(ex, str(o)) for ex, o in zip(c.examples, obs)],
                box.prompt_tools, box.template_kwargs)
    finally:
        box.close()


def check_reward_models(c: Checker) -> str:
    """Which reward_fns entries are reward models, and what their config.json says (no weights are loaded: the
    ref server loads and checks them at its start; common/settings/reward_models.py)."""
    from common.settings.reward_models import config_refusal, describe_config

    out = []
    for m in c.cfg.reward_models():
        why = config_refusal(m["path"], m["name"])
        if why:
            raise ValueError(why)
        out.append(f"{m['spec']!r} is a reward model named {m['name']!r} ({describe_config(m['path'])}), scored by "
                   f"the ref server")
    return "; ".join(out)


def check_rewards(c: Checker) -> str:
    """A whole group (num_generations completions: right, wrong and malformed answers) for each of the first rows,
    scored as training scores them (RewardScorer.score_group, completion ids included): a reward that raises on
    one row, or returns the wrong count only for a full group, fails here rather than minutes into the run."""
    from dataclasses import replace

    from trainer.rewards.scoring import RewardScorer
    if c.cfg.reward_models() and len(c.cfg.reward_models()) == len(c.cfg.reward_specs()) \
            and not c.cfg.env_reward_names():
        return "no reward function besides the reward models"
    scorer = RewardScorer.from_config(c.cfg, reward_models=False)  # as the workers build it, less the models
    values: dict[str, list] = {n: [] for n in scorer.names}
    try:
        envs = _environment_copies(c) if scorer.wants_environments else [None] * len(c.examples)
        if not c.examples:
            return f"{', '.join(scorer.names)} imported (no data row to score a group)"
        for row, ex in enumerate(c.examples):
            ex = replace(ex, index=row) if ex.index is None else ex
            completions = _group(ex, c.cfg.num_pre_Q)
            ids = ([c.tokenizer(x, add_special_tokens=False)["input_ids"] for x in completions]
                   if c.tokenizer is not None else None)
            copies = None if envs[row] is None else [envs[row]] * len(completions)
            for name, vals in scorer.score_group(ex, completions, ids, environments=copies).components.items():
                values[name].extend(vals)
    finally:
        scorer.close()
    return f"{len(c.examples)} groups of {c.cfg.num_pre_Q} scored: " + ", ".join(
        f"{n}={_summary(v)}" for n, v in values.items())


def _environment_copies(c: Checker) -> list[dict]:
    """For rewards that take TRL's `environments`: each row's instance as its reset() leaves it, copied as the
    tool loop copies it (trainer/rewards/environments.py): a class that cannot be copied fails here."""
    from trainer.rollout import reset_kwargs
    from trainer.tools import ToolBox
    box = ToolBox.from_config(c.cfg, c.tokenizer)
    try:
        ids = box.start_episodes(len(c.examples), [reset_kwargs(ex) for ex in c.examples])
        copies = box.episode_snapshots(ids)
        box.end_episodes(ids)
        return copies
    finally:
        box.close()


def _group(ex, n: int) -> list[str]:
    """n completions for one row: the well-formed right answer first, then wrong and malformed ones."""
    gt = "" if ex.ground_truth is None else str(ex.ground_truth)
    kinds = [ANSWER.format(gt), ANSWER.format(gt + "1"), gt, "I do not know.", "", f"<answer>{gt}</answer>"]
    return [kinds[k % len(kinds)] for k in range(n)]


def _summary(vals: list) -> str:
    got = [v for v in vals if v is not None]
    nones = len(vals) - len(got)
    if not got:
        return f"None on all {len(vals)} (not applicable: this reward alone gives no signal)"
    return (f"{min(got):g}..{max(got):g}" if min(got) != max(got) else f"{got[0]:g}") + (
        f" ({nones} None)" if nones else "")


def check_port(host: str, port: int) -> str:
    from common.listen import listen_socket
    try:  # as the ref server binds it (common/listen.py): its host, SO_REUSEADDR (TIME-WAIT is free)
        listen_socket(host, port).close()
    except OSError as e:
        raise OSError(f"port {port} is taken on {host} ({e.strerror}): pick another with --port") from None
    return f"{port} on {host} is free"


def model_bytes(model_path: str, options: dict | None = None) -> int:
    """The checkpoint's size on disk when it is a local folder, else parameters x 2 bytes (bf16) from config."""
    folder = Path(model_path)
    if folder.is_dir():
        files = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
        if files:
            return sum(p.stat().st_size for p in files)
    from common.modeling import load_model_config
    conf = load_model_config(model_path, options)
    h, n, v = conf.hidden_size, conf.num_hidden_layers, conf.vocab_size
    inter = getattr(conf, "intermediate_size", 4 * h)
    return 2 * (v * h * (1 if getattr(conf, "tie_word_embeddings", False) else 2) + n * (4 * h * h + 3 * h * inter))


def check_disk(c: Checker, run_dir: Path) -> str:
    need = 2 * model_bytes(c.model_path, c.cfg.load_options())
    where = run_dir
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise OSError(f"{free / 1e9:.1f} GB free under {where}, a checkpoint needs about {need / 2e9:.1f} GB: "
                      f"at least {need / 1e9:.1f} GB (twice the model) is needed")
    return f"{free / 1e9:.1f} GB free under {where} (twice the model: {need / 1e9:.2f} GB)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m trainer.check", allow_abbrev=False,
                                 description="Check a run's config, model, data, rewards, port and disk without "
                                             "loading weights (what ./launch.sh check runs).")
    ap.add_argument("--port", type=int, default=59875, help="the ref server's port (default 59875)")
    ap.add_argument("--host", default="127.0.0.1", help="the address the ref server binds (default 127.0.0.1, its own)")
    ap.add_argument("--ref-url", "--ref_url", default="", help="a running ref server: no port to check")
    ap.add_argument("--run-dir", "--run_dir", default="runs", help="where checkpoints would go")
    args = ap.parse_args(own)
    c = Checker()
    c.run("config", lambda: check_config(c, trainer_args))
    if c.cfg is None:
        for name in ("model", "data", "rewards", "disk"):
            c.skip(name, "the config did not load")
    else:
        c.run("model", lambda: check_model(c))
        c.run("data", lambda: check_data(c))
        if c.cfg.reward_models():
            c.run("reward models", lambda: check_reward_models(c))
        if c.cfg.agent:  # the agent once against the real endpoint, its rollout scored (trainer/check_agent.py)
            from trainer.check_agent import check_agent
            c.run("agent", lambda: check_agent(c))
        else:
            c.run("rewards", lambda: check_rewards(c))
        if c.cfg.tools or c.cfg.environment_factory:
            from trainer.check_tools import check_tools
            check_tools(c)
    if not args.ref_url:
        c.run("port", lambda: check_port(args.host, args.port))
    if c.model_path is not None:
        c.run("disk", lambda: check_disk(c, Path(args.run_dir).resolve()))
    if c.failed:
        print(f"check: {len(c.failed)} failed ({', '.join(c.failed)})", flush=True)
        return 1
    print("check: all passed", flush=True)
    return 0


if __name__ == "__main__":
    from common.fast_exit import exit_cleanly
    from common.gc_pause import imports_without_gc
    with imports_without_gc():  # a check is mostly imports: torch, transformers, the user's modules
        code = main()
    exit_cleanly(code)  # scorers, tool boxes, port probe closed: skip the teardown
