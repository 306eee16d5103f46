"""TRL `GRPOConfig` names accepted as aliases of ours, in the JSON config and on the command line.

Every alias maps to exactly one of our fields (some with a value translation); names TRL shares with us
(`beta`, `temperature`, `seed`, `loss_type`, `top_entropy_quantile`, the `vllm_importance_sampling_*` fields,
`trust_remote_code`, `model_init_kwargs`, `vllm_tensor_parallel_size`, ...) need no alias. A TRL name we cannot
honour is refused by name, never ignored; giving an alias and our own name for the same knob in one place with
different values is an error (the same value under both names, `--use_vllm true --gen_backend vllm`, is accepted).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

# TRL scale_rewards -> our advantage_mode (bools are TRL's older spelling).
SCALE_REWARDS = {"group": "grpo", "true": "grpo", "batch": "grpo_batch_std", "none": "grpo_no_std",
                 "false": "grpo_no_std"}
SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    key = str(v).strip().lower()
    if key not in ("true", "false"):
        raise ValueError(f"TRL {name}={v!r} must be true or false")
    return key == "true"


def _resume(v: Any) -> bool:
    if isinstance(v, bool) or str(v).strip().lower() in ("true", "false"):
        return _bool(v, "resume_from_checkpoint")
    raise ValueError(f"TRL resume_from_checkpoint={v!r}: a checkpoint path is not supported; set output_dir to the "
                     f"run's folder and resume_from_checkpoint (or resume) true: it continues from its newest")


def _pick(table: dict, trl_name: str):
    def conv(v: Any) -> str:
        key = str(v).strip().lower()
        if key not in table:
            raise ValueError(f"TRL {trl_name}={v!r} is not supported here; supported: {', '.join(table)}")
        return table[key]
    return conv


# TRL name -> (our field, value translation or None, what it means for --help)
ALIASES: dict[str, tuple[str, Any, str]] = {
    # TRL's script arguments for the data (`trl grpo --dataset_name ...`); dataset_config is our field's own name
    "dataset_name": ("data", None, "training data: hub id, folder or file"),
    "dataset_train_split": ("data_split", None, "training split"),
    "dataset_test_split": ("eval_split", None, "evaluation split"),
    "reward_funcs": ("reward_fns", None, "GRPOTrainer's argument: the reward functions (built-ins, dotted paths, "
                     "reward models)"),
    "num_generations": ("num_pre_Q", None, "completions per prompt"),
    "max_completion_length": ("max_new_tokens", None, "completion length cap"),
    "learning_rate": ("lr", None, "peak learning rate"),
    "epsilon": ("eps_low", None, "lower clip; also eps_high unless epsilon_high/eps_high is given (as TRL); at "
                "importance_sampling_level sequence it is the sequence clip (gspo_eps_low/high), as TRL's"),
    "epsilon_high": ("eps_high", None, "upper clip (also gspo_eps_high: the sequence clip, as TRL's)"),
    "use_vllm": ("gen_backend", lambda v: "vllm" if _bool(v, "use_vllm") else "hf",
                 "true -> gen_backend vllm (the genonly workers generate with vLLM; launch.sh --vllm), false -> hf"),
    "num_iterations": ("mu", None, "optimizer updates per generation round"),
    "scale_rewards": ("advantage_mode", _pick(SCALE_REWARDS, "scale_rewards"),
                      "group->grpo, batch->grpo_batch_std, none->grpo_no_std"),
    "mask_truncated_completions": ("mask_truncated", None, "drop truncated completions from the loss"),
    "max_grad_norm": ("grad_clip", None, "gradient norm clip"),
    "lr_scheduler_type": ("lr_schedule", _pick(SCHEDULERS, "lr_scheduler_type"),
                          "constant, constant_with_warmup->constant, linear, cosine (others refused)"),
    "max_steps": ("all_steps", None, "training steps (optimizer updates)"),
    "vllm_importance_sampling_cap": ("vllm_importance_sampling_clip_max", None, "TRL's deprecated name of clip_max"),
    "per_device_train_batch_size": ("micro_batch_size", None, "completions per forward/backward on a device; "
                                    "the batch itself stays num_pre_Q x Q_batch_size x train_batch_groups"),
    "logging_steps": ("log_every", None, "metrics row every N steps"),
    "gradient_accumulation_steps": ("grad_accum", None, "training batches accumulated into one optimizer update. "
                                    "Unlike TRL, it does not size generation: TRL generates "
                                    "per_device_train_batch_size x processes x steps_per_generation (default: "
                                    "gradient_accumulation_steps) completions per round; here a round is num_pre_Q "
                                    "x Q_batch_size and each batch train_batch_groups groups, whatever grad_accum"),
    "model_revision": ("revision", None, "TRL ModelConfig's name of the hub revision"),
    "model_name_or_path": ("model", None, "TRL ModelConfig's name of the policy model"),
    "vllm_max_model_length": ("vllm_max_model_len", None, "vLLM's context (prompt + completion)"),
    "resume_from_checkpoint": ("resume", lambda v: _resume(v), "true: continue from the last DeepSpeed checkpoint "
                               "in output_dir (a checkpoint path is refused: resume takes output_dir's newest)"),
}

# TRL GRPOConfig / TrainingArguments names we cannot honour, with the reason given to the user.
_VLLM = "vLLM is configured with gen_backend (TRL's use_vllm) and our vllm_* fields, not this TRL option"
_REF = "the reference model is frozen on the ref server"
_BATCH = "batch shape is num_pre_Q x Q_batch_size x train_batch_groups here"
_GEN = "the HF engine runs transformers' generate with its default cache (vLLM workers: gen_backend vllm)"
REFUSED: dict[str, str] = {
    **{n: _GEN for n in ("cache_implementation", "use_transformers_paged", "use_transformers_continuous_batching",
                         "transformers_continuous_batching_config")},
    **{n: _VLLM for n in (
        "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_group_port",
        "vllm_server_timeout", "vllm_model_impl", "vllm_structured_outputs_regex", "vllm_guided_decoding_regex",
        "vllm_enable_sleep_mode")},
    "generation_batch_size": _BATCH, "steps_per_generation": _BATCH,
    "num_generations_eval": "evaluation is greedy, one completion per prompt (eval_limit prompts)",
    "per_device_eval_batch_size": "evaluation batches are gen_batch_size sequences",
    "delta": "two-sided clipping (delta) is not implemented",
    "sync_ref_model": _REF, "ref_model_mixup_alpha": _REF, "ref_model_sync_steps": _REF,
    "disable_dropout": "the policy trains with the model's own dropout settings",
    "use_liger_loss": "the loss is trainer/objective/grpo.py",
    "router_aux_loss_coef": "MoE router auxiliary loss is not added to the objective",
    "pad_to_multiple_of": "forwards are packed (padding_free) or padded to the micro-batch's longest row",
    "vespo_k_pos": "loss_type vespo is not implemented", "vespo_lambda_pos": "loss_type vespo is not implemented",
    "vespo_k_neg": "loss_type vespo is not implemented", "vespo_lambda_neg": "loss_type vespo is not implemented",
    "multi_objective_aggregation": "rewards are summed with reward_weights, then normalised per group (TRL's "
                                   "sum_then_normalize)",
    **{n: "an entropy bonus is not implemented (top_entropy_quantile is)" for n in (
        "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
        "entropy_target")},
    "wandb_log_unique_prompts": "completions.jsonl and the W&B table log every completion",
    "log_unique_prompts": "completions.jsonl and the W&B table log every completion",
    "log_multimodal": "multimodal prompts are not supported",
    "log_completions_hub_repo": "pushing to the Hugging Face Hub is not supported",
    "shuffle_dataset": "the prompt sampler always shuffles (seeded)",
    "ds3_gather_for_generation": "ZeRO-3 generation gathers always",
    "lr_scheduler_kwargs": "use lr_schedule and warmup_steps",
    "fp16": "precision comes from bf16 / ds_config (float16 training is not supported)",
    "optim": "the optimizer is DeepSpeed's AdamW from ds_config",
    "adam_beta1": "set betas in ds_config", "adam_beta2": "set betas in ds_config",
    "adam_epsilon": "set eps in ds_config",
    "push_to_hub": "pushing to the Hugging Face Hub is not supported",
    "hub_model_id": "pushing to the Hugging Face Hub is not supported",
    "cast_lm_head_to_fp32": "precision comes from bf16 / ds_config",
    "remove_unused_columns": "every dataset column always reaches TRL-style rewards (as TRL's False)",
    "eval_strategy": "evaluation runs every eval_steps steps (and eval_before)",
    "logging_dir": "logs go to output_dir (metrics.jsonl, TensorBoard)",
    "gradient_checkpointing_kwargs": "gradient checkpointing takes no options here",
    "use_liger_kernel": "Liger kernels are not applied (the model's own modules run)",
    "torch_empty_cache_steps": "the CUDA cache is not emptied on a schedule",
}
# Values of refused names that are what we do anyway: accepted (nothing to set), so TRL recipe files run.
MATCHING: dict[str, tuple] = {
    "remove_unused_columns": (False,), "shuffle_dataset": (True,), "push_to_hub": (False,), "hub_model_id": (None,),
    "ds3_gather_for_generation": (True,), "sync_ref_model": (False,), "disable_dropout": (False,),
    "use_liger_loss": (False, None), "fp16": (False,), "delta": (None,), "cast_lm_head_to_fp32": (False,),
    "use_transformers_paged": (False,), "use_transformers_continuous_batching": (False,),
    "transformers_continuous_batching_config": (None,), "cache_implementation": (None,),
    "vllm_enable_sleep_mode": (False,), "vllm_structured_outputs_regex": (None,),
    "vllm_guided_decoding_regex": (None,), "generation_batch_size": (None,), "steps_per_generation": (None,),
    "lr_scheduler_kwargs": (None,), "log_completions_hub_repo": (None,), "log_multimodal": (False,),
    "log_unique_prompts": (False,), "wandb_log_unique_prompts": (False,), "entropy_coef": (0, 0.0),
    "use_adaptive_entropy": (False,), "router_aux_loss_coef": (0, 0.0), "pad_to_multiple_of": (None,),
    "num_generations_eval": (None,),
    "multi_objective_aggregation": ("sum_then_normalize",),
    "use_liger_kernel": (False,), "torch_empty_cache_steps": (None,), "gradient_checkpointing_kwargs": (None,),
    "optim": ("adamw_torch", "adamw_torch_fused"), "adam_beta1": (0.9,), "adam_epsilon": (1e-8,),
}


def cli_value(s: str) -> Any:
    """A refused name's value from the command line, read as JSON where it is (true, 0.9, null), else text."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def _matches(name: str, value: Any) -> bool:
    ok = MATCHING.get(name, ())
    return any(value is v if v is None or isinstance(v, bool) or isinstance(value, bool) else value == v
               for v in ok)


def refusal(name: str, value: Any) -> str:
    ok = MATCHING.get(name)
    also = f"; accepted: {', '.join(json.dumps(v) for v in ok)} (what this trainer does)" if ok else ""
    return f"{name!r}={value!r} ({REFUSED[name]}{also})"


def help_lines() -> list[str]:
    return [f"--{a} -> --{f}: {h}" for a, (f, _, h) in ALIASES.items()]


def resolve(values: dict, defaults: dict, field_names: set[str], source: str, given_before: frozenset = frozenset()
            ) -> dict:
    """Translate TRL names in one source's values (a JSON file or the CLI) into ours. given_before: the names an
    earlier source (the file, under the CLI) gave explicitly: TRL's epsilon_high defaults to epsilon only where no
    source gave it, so a command-line --epsilon leaves the file's epsilon_high as it is."""
    out = dict(values)
    for k in [k for k in out if k in REFUSED and k not in field_names and _matches(k, out[k])]:
        out.pop(k)  # what we do anyway (a TRL recipe's `remove_unused_columns: false`)
    refused = sorted(k for k in out if k in REFUSED and k not in field_names)
    if refused:
        raise ValueError(f"{source}: TRL GRPOConfig field(s) we cannot honour: "
                         + "; ".join(refusal(k, out[k]) for k in refused))
    if out.get("max_steps") is not None and out["max_steps"] == -1:
        out.pop("max_steps")  # TRL's "no step count: num_train_epochs decides"
    if out.get("warmup_ratio") is not None and "warmup_steps" in out:
        steps = out.get("all_steps", out.get("max_steps", defaults.get("all_steps")))
        if out["warmup_steps"] not in (0, math.ceil(float(out["warmup_ratio"]) * int(steps))):
            raise ValueError(f"{source}: both warmup_ratio and warmup_steps are given; give one")
        out.pop("warmup_steps")  # TRL's default 0, or what the ratio gives (a run's saved config.json)
    if out.get("num_train_epochs") is not None and ("max_steps" in out or "all_steps" in out):
        out["num_train_epochs"] = None  # as TRL: a step count overrides num_train_epochs
    for alias, (target, conv, _) in ALIASES.items():
        if alias not in out or alias in field_names:
            continue
        raw = out.pop(alias)
        value = conv(raw) if conv is not None and raw is not None else raw
        if target in out and out[target] != value:  # the same meaning under both names is no conflict
            raise ValueError(f"{source}: the TRL name {alias!r} ({raw!r}) and our {target!r} ({out[target]!r}) are "
                             f"given for one knob with different values; give one")
        out[target] = value
    high_given = {"eps_high", "epsilon_high"} & (set(values) | set(given_before))
    if "epsilon" in values and not high_given:
        out["eps_high"] = out["eps_low"]  # TRL: epsilon_high defaults to epsilon (where no source gave it)
    # TRL's epsilon / epsilon_high clip at whichever importance_sampling_level: also our sequence clip
    for trl, ours, mine in (("epsilon", "gspo_eps_low", "eps_low"), ("epsilon_high", "gspo_eps_high", "eps_high"),
                            ("epsilon", "gspo_eps_high", "eps_high")):
        if trl in values and trl not in field_names and mine in out:
            if ours in values and values[ours] != out[mine]:
                raise ValueError(f"{source}: the TRL name {trl!r} and our {ours!r} are given for the sequence "
                                 f"clip with different values; give one")
            out[ours] = out[mine]
    return out


# Pairs where a later source's one name overrides an earlier source's other (the CLI over the file).
OVERRIDES = (("warmup_ratio", "warmup_steps"), ("num_train_epochs", "all_steps"))


def merge(earlier: dict, later: dict) -> dict:
    """earlier <- later (both already resolved): a later warmup_steps drops an earlier warmup_ratio, and so on."""
    out = dict(earlier)
    for a, b in OVERRIDES:
        if later.get(a) is not None and b not in later:
            out.pop(b, None)
        if b in later and later.get(a) is None:
            out.pop(a, None)
    out.update(later)
    return out


def resolve_for(cls: type, values: dict, source: str, given_before: frozenset = frozenset()) -> dict:
    fields = dataclasses.fields(cls)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    return resolve(values, defaults, {f.name for f in fields}, source, given_before)


# Our names that are also plain words in a message's prose: never rewritten to the TRL name
_PROSE = {"model", "data", "resume", "revision"}


def as_written(message: str, given: set[str], field_names: set[str]) -> str:
    """A validation message with each knob the user gave under its TRL name (`given`: the names of a file's keys and
    the command line's options) called by that name (`num_pre_Q must be >= 2` to a user who wrote num_generations)."""
    for alias, (target, _, _) in ALIASES.items():
        if alias in given and alias not in field_names and target not in given and target not in _PROSE:
            message = re.sub(rf"(?<![\w.-]){re.escape(target)}(?![\w-])", alias, message)
    return message
