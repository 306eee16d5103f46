"""TRL `GRPOConfig` names accepted as aliases of ours, in the JSON config and on the command line.

Every alias maps to exactly one of our fields (some with a value translation); names TRL shares with us
(`beta`, `temperature`, `seed`, `loss_type`, `top_entropy_quantile`, the `vllm_importance_sampling_*` fields,
`trust_remote_code`, `model_init_kwargs`, `vllm_tensor_parallel_size`, ...) need no alias. A TRL name we cannot
honour is refused by name, never ignored; giving an alias and our own name for the same knob in one place is an error.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

# TRL scale_rewards -> our advantage_mode (bools are TRL's older spelling).
SCALE_REWARDS = {"group": "grpo", "true": "grpo", "batch": "grpo_batch_std", "none": "grpo_no_std",
                 "false": "grpo_no_std"}
SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}


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
    "num_generations": ("num_pre_Q", None, "completions per prompt"),
    "max_completion_length": ("max_new_tokens", None, "completion length cap"),
    "learning_rate": ("lr", None, "peak learning rate"),
    "epsilon": ("eps_low", None, "lower clip; also eps_high unless epsilon_high/eps_high is given (as TRL)"),
    "epsilon_high": ("eps_high", None, "upper clip"),
    "num_iterations": ("mu", None, "optimizer updates per generation round"),
    "scale_rewards": ("advantage_mode", _pick(SCALE_REWARDS, "scale_rewards"),
                      "group->grpo, batch->grpo_batch_std, none->grpo_no_std"),
    "mask_truncated_completions": ("mask_truncated", None, "drop truncated completions from the loss"),
    "max_grad_norm": ("grad_clip", None, "gradient norm clip"),
    "warmup_ratio": ("warmup_steps", None, "warmup_steps = ceil(ratio * all_steps) optimizer steps"),
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
}

# TRL GRPOConfig / TrainingArguments names we cannot honour, with the reason given to the user.
_GEN = "generation settings beyond temperature/top_p/top_k are not implemented"
REFUSED: dict[str, str] = {
    **{n: _GEN for n in ("min_p", "repetition_penalty", "generation_kwargs", "cache_implementation",
                         "use_transformers_paged", "chat_template_kwargs")},
    **{n: "vLLM is configured with gen_backend and its own fields, not TRL's vllm_* options" for n in (
        "use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
        "vllm_server_timeout", "vllm_gpu_memory_utilization", "vllm_model_impl",
        "vllm_guided_decoding_regex", "vllm_enable_sleep_mode")},
    "generation_batch_size": "batch shape is num_pre_Q x Q_batch_size x train_batch_groups here",
    "steps_per_generation": "batch shape is num_pre_Q x Q_batch_size x train_batch_groups here",
    "num_train_epochs": "training length is all_steps (alias max_steps)",
    "delta": "two-sided clipping (delta) is not implemented",
    "sync_ref_model": "the reference model is frozen on the ref server",
    "ref_model_mixup_alpha": "the reference model is frozen on the ref server",
    "ref_model_sync_steps": "the reference model is frozen on the ref server",
    "disable_dropout": "the policy trains with the model's own dropout settings",
    "use_liger_loss": "the loss is trainer/objective/grpo.py",
    "wandb_log_unique_prompts": "completions.jsonl and the W&B table log every completion",
    "shuffle_dataset": "the prompt sampler always shuffles (seeded)",
    "ds3_gather_for_generation": "ZeRO-3 generation gathers always",
    "lr_scheduler_kwargs": "use lr_schedule and warmup_steps",
    "fp16": "precision comes from ds_config", "optim": "the optimizer is AdamW from ds_config",
    "adam_beta1": "set betas in ds_config", "adam_beta2": "set betas in ds_config",
    "adam_epsilon": "set eps in ds_config",
    "push_to_hub": "not supported",
    "cast_lm_head_to_fp32": "precision comes from ds_config",
    "remove_unused_columns": "every dataset column always reaches TRL-style rewards (as TRL's False)",
}


def help_lines() -> list[str]:
    return [f"--{a} -> --{f}: {h}" for a, (f, _, h) in ALIASES.items()]


def resolve(values: dict, defaults: dict, field_names: set[str], source: str) -> dict:
    """Translate TRL names in one source's values (a JSON file or the CLI) into ours."""
    out = dict(values)
    refused = sorted(k for k in out if k in REFUSED and k not in field_names)
    if refused:
        raise ValueError(f"{source}: TRL GRPOConfig field(s) we cannot honour: "
                         + "; ".join(f"{k!r} ({REFUSED[k]})" for k in refused))
    for alias, (target, conv, _) in ALIASES.items():
        if alias not in out or alias in field_names:
            continue
        if target in out:
            raise ValueError(f"{source}: both the TRL name {alias!r} and our {target!r} are given for one knob; "
                             f"give one")
        value = out.pop(alias)
        if alias == "warmup_ratio":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ValueError(f"{source}: warmup_ratio must be a number in [0, 1], got {value!r}")
            steps = out.get("all_steps", out.get("max_steps", defaults["all_steps"]))
            value = math.ceil(float(value) * int(steps))  # a step is one optimizer update, as TRL's
        out[target] = conv(value) if conv is not None and value is not None else value
    if "epsilon" in values and "eps_high" not in values and "epsilon_high" not in values:
        out["eps_high"] = out["eps_low"]  # TRL: epsilon_high defaults to epsilon
    return out


def resolve_for(cls: type, values: dict, source: str, base: dict | None = None) -> dict:
    """`base`: values already set by an earlier source (the file, for the CLI), seen by warmup_ratio."""
    fields = dataclasses.fields(cls)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    defaults.update(base or {})
    return resolve(values, defaults, {f.name for f in fields}, source)
