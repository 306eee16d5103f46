"""One config dataclass for every knob, loadable from a JSON file and overridable on the CLI.

    cfg = load_config(GRPOConfig, ["--config", "configs/demo.json", "--lr", "1e-4"])

Every field carries a `help` string in its metadata; `--help` prints them all. The same
mechanism serves the ref server's `ServerConfig` (ref_server/config.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

T = TypeVar("T")


def knob(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with documentation attached (shown by --help)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GRPOConfig:
    # --- model and data -------------------------------------------------------------
    model: str = knob("tiny", "Policy model: a Hugging Face id or local directory. 'tiny' builds/caches the "
                              "embedded tiny Qwen2 model (python -m common.tiny_model).")
    ref_model: Optional[str] = knob(None, "Reference model for the ref server (defaults to `model`).")
    data: str = knob("openai/gsm8k", "Training data: a hub id (datasets.load_dataset), a directory with "
                                     "{split}.jsonl/.parquet, or one .jsonl/.parquet file. 'arith' = the "
                                     "built-in synthetic arithmetic task.")
    data_split: str = knob("train", "Split used for training.")
    eval_split: str = knob("test", "Split used for evaluation.")
    data_limit: Optional[int] = knob(None, "Use at most this many training examples.")
    system_prompt: Optional[str] = knob("default", "System prompt for the chat template; 'default' = the R1-style "
                                                    "prompt in trainer/data.py, '' = none.")
    reward_fns: list = knob(["correct", "format"], "Reward functions summed per completion: built-in names "
                                                   "(correct, format, countdown, contains) or dotted paths.")
    # --- ref server -----------------------------------------------------------------
    ref_server: str = knob("http://127.0.0.1:59875", "Ref server URL (comma-separated list to spread uploads).")
    ref_token: Optional[str] = knob(None, "Bearer token for the ref server (or set GRPO_REF_TOKEN).")
    ref_timeout: float = knob(30.0, "Seconds an HTTP call to the ref server may take.")
    num_gen_workers: int = knob(0, "How many genonly workers feed the server. 0 = trainer ranks generate "
                                   "themselves whenever no scored batch is ready.")
    get_wait: float = knob(2.0, "With genonly workers: seconds a rank waits for a scored batch before it "
                                "generates one itself (0 = wait for workers only).")
    # --- GRPO -----------------------------------------------------------------------
    num_pre_Q: int = knob(8, "Completions sampled per question (group size).")
    Q_batch_size: int = knob(1, "Questions per generation round (one uploaded batch per question).")
    train_batch_groups: int = knob(1, "Scored batches (groups) concatenated into one training batch.")
    max_prompt_length: int = knob(512, "Prompts longer than this (tokens) are skipped and counted.")
    max_new_tokens: int = knob(512, "Maximum completion length.")
    temperature: float = knob(0.9, "Sampling temperature for rollouts.")
    top_p: float = knob(1.0, "Nucleus sampling for rollouts.")
    beta: float = knob(0.04, "KL coefficient (k3 estimator against the reference model). 0 disables the ref "
                             "logprob computation on the server.")
    eps_low: float = knob(0.2, "Lower clip epsilon of the policy ratio.")
    eps_high: float = knob(0.2, "Upper clip epsilon of the policy ratio (raise for DAPO-style clip-higher).")
    compute_gen_logps: bool = knob(True, "Upload generation-time logprobs and use the clipped ratio; False = "
                                         "REINFORCE form exp(logp - logp.detach()) * A.")
    advantage_mode: str = knob("grpo", "grpo (r-mean)/std, grpo_no_std (r-mean) or raw (r).")
    aggregation: str = knob("seq_mean", "Loss aggregation: seq_mean (simple_GRPO), token_mean or dr_grpo.")
    mu: int = knob(1, "Optimisation passes per training batch.")
    mask_truncated: bool = knob(False, "Drop completions that hit max_new_tokens without EOS from the loss.")
    # --- optimisation ---------------------------------------------------------------
    lr: float = knob(1e-6, "Peak learning rate (AdamW).")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    lr_schedule: str = knob("constant", "constant or cosine (both with linear warmup).")
    warmup_steps: int = knob(0, "Linear warmup steps.")
    grad_clip: float = knob(1.0, "Gradient norm clip.")
    grad_accum: int = knob(1, "Gradient accumulation steps (DeepSpeed).")
    zero_stage: Optional[int] = knob(None, "Override the ZeRO stage of ds_config (2 by default; 3 works).")
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward to save memory.")
    ds_config: str = knob("ds_config.json", "DeepSpeed config file (batch, precision and optimizer fields "
                                            "are filled from this config).")
    logp_chunk_tokens: int = knob(1024, "Positions per chunk in the per-token logprob computation "
                                        "(bounds the B x chunk x V logits held at once).")
    # --- run ------------------------------------------------------------------------
    all_steps: int = knob(1000, "Training steps (one training batch each).")
    save_steps: int = knob(200, "Save an HF checkpoint every N steps (and at the end).")
    eval_steps: int = knob(0, "Evaluate every N steps (0 = never during training).")
    eval_before: bool = knob(False, "Evaluate the base model before training.")
    eval_limit: int = knob(200, "Examples per evaluation.")
    eval_max_new_tokens: Optional[int] = knob(None, "Max new tokens in evaluation (default max_new_tokens).")
    seed: int = knob(42, "Random seed (rank/worker offsets are added).")
    output_dir: str = knob("runs/grpo", "Where checkpoints, metrics.jsonl and TensorBoard logs go.")
    resume: bool = knob(False, "Continue from the last DeepSpeed checkpoint in output_dir.")
    wandb: bool = knob(False, "Also log to Weights & Biases (must be installed).")
    log_every: int = knob(1, "Write a metrics row every N steps.")
    gen_batch_size: int = knob(64, "Max sequences generated in one HF generate call.")
    worker_rounds: int = knob(0, "genonly: stop after this many generation rounds (0 = run until stopped).")
    worker_id: int = knob(0, "genonly: this worker's index (seeds and prompt shard; launch.sh sets it).")
    device: str = knob("auto", "genonly/eval device: auto, cpu or cuda:N (trainer ranks use their local GPU).")

    def validate(self) -> "GRPOConfig":
        checks = [
            (self.num_pre_Q >= 2, "num_pre_Q must be >= 2 (a group needs a spread)"),
            (self.Q_batch_size >= 1, "Q_batch_size must be >= 1"),
            (self.advantage_mode in ("grpo", "grpo_no_std", "raw"), f"unknown advantage_mode {self.advantage_mode!r}"),
            (self.aggregation in ("seq_mean", "token_mean", "dr_grpo"), f"unknown aggregation {self.aggregation!r}"),
            (self.lr_schedule in ("constant", "cosine"), f"unknown lr_schedule {self.lr_schedule!r}"),
            (self.beta >= 0, "beta must be >= 0"),
            (0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low in [0,1) and eps_high >= 0"),
            (self.mu >= 1, "mu must be >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature > 0, "temperature must be > 0"),
            (self.zero_stage in (None, 0, 1, 2, 3), "zero_stage must be 0..3"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"config: {msg}")
        return self


# ---------------------------------------------------------------------------------------
def _base_type(tp: Any) -> Any:
    """Optional[X] -> X; list -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return origin or tp


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def _parse_list(s: str) -> list:
    s = s.strip()
    if s.startswith("["):
        return json.loads(s)
    return [p for p in (x.strip() for x in s.split(",")) if p]


def _converter(tp: Any, optional: bool):
    base = _base_type(tp)
    conv = {bool: _parse_bool, int: int, float: float, str: str, list: _parse_list}[base]
    if optional:
        return lambda s: None if s.strip().lower() in ("none", "null") else conv(s)
    return conv


def build_parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON file with any of the fields below (CLI flags override it).")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        p.add_argument(f"--{f.name}", dest=f.name, type=_converter(tp, optional), default=argparse.SUPPRESS,
                       help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"))
    return p


def _check_value(name: str, tp: Any, value: Any, source: str) -> Any:
    """A JSON value must have the field's type (an int is fine for a float); anything else is an error."""
    optional = type(None) in typing.get_args(tp)
    if value is None and optional:
        return None
    base = _base_type(tp)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (bool, int, float, str, list, dict):
        ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
        if not ok:
            want = base.__name__ + (" or null" if optional else "")
            raise ValueError(f"{source}: field {name!r} must be {want}, got {value!r} ({type(value).__name__})")
    return value


def from_dict(cls: type[T], values: dict, source: str = "config") -> T:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}; see --help for the valid ones")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _check_value(k, hints[k], v, source) for k, v in values.items()})


def load_config(cls: type[T], argv: list[str] | None = None, prog: str | None = None,
                ignore_unknown: tuple[str, ...] = ()) -> T:
    """Defaults <- JSON file (--config) <- CLI flags. Unknown keys are errors, not ignored."""
    parser = build_parser(cls, prog=prog)
    for name in ignore_unknown:  # e.g. --local_rank injected by the deepspeed launcher
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ns = vars(parser.parse_args(argv))
    for name in ignore_unknown:
        ns.pop(name, None)
    values: dict = {}
    cfg_file = ns.pop("config", None)
    if cfg_file:
        path = Path(cfg_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            values.update(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from e
    values.update(ns)
    cfg = from_dict(cls, values, source=str(cfg_file or "command line"))
    validate = getattr(cfg, "validate", None)
    return validate() if validate else cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
