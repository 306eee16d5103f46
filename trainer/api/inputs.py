"""GRPOTrainer's arguments as this system's config fields: the model by name, rewards / tools / environments by spec
(trainer/api/names.py), a peft.LoraConfig as our lora_* knobs, tokenizers by name, datasets as parquet files.
Anything TRL takes that we cannot honour is refused by name, with the reason."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from trainer.api.names import spec_of, specs_of

# TRL GRPOTrainer arguments we cannot honour (value None / empty is what we do anyway), with the reason.
REFUSED_ARGS = {
    "callbacks": "the training loop runs in other processes (DeepSpeed ranks), where a TrainerCallback cannot reach; "
                 "read trainer.state.log_history after train(), or output_dir/metrics.jsonl while it runs",
    "optimizers": "the optimizer is DeepSpeed's AdamW from ds_config (lr, weight_decay, lr_scheduler_type in "
                  "GRPOConfig)",
    "quantization_config": "quantized (bitsandbytes) training is not supported",
    "rollout_func": "rollouts are this system's (tools, environment_factory or agent give them turns of their own)",
}


def refuse_unsupported(given: dict) -> None:
    bad = [n for n, v in given.items() if n in REFUSED_ARGS and v not in (None, [], (None, None))]
    if bad:
        raise ValueError("GRPOTrainer: argument(s) we cannot honour: "
                         + "; ".join(f"{n} ({REFUSED_ARGS[n]})" for n in bad))


def model_name(model: Any) -> str:
    """A name, a path, or a loaded PreTrainedModel whose name_or_path every process loads (said so on stderr)."""
    if isinstance(model, (str, Path)):
        return str(model)
    if hasattr(model, "peft_config"):
        raise ValueError("GRPOTrainer: model is a PeftModel; pass the base model (or its name) and the LoraConfig as "
                         "peft_config")
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        raise ValueError(f"GRPOTrainer: model {type(model).__name__} has no name_or_path; save it with "
                         f"model.save_pretrained(dir) and pass dir")
    print(f"[api] model: a loaded {type(model).__name__}; every process loads {name} (its name_or_path), not the "
          f"weights held in this script", file=sys.stderr)
    return str(name)


def reward_specs(reward_funcs: Any) -> list[str]:
    """TRL's reward_funcs: callables, module paths, reward model ids or folders, loaded reward models."""
    items = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    out = []
    for i, f in enumerate(items):
        if isinstance(f, (str, Path)):
            out.append(str(f))
        elif hasattr(f, "config") and hasattr(f, "name_or_path"):  # a loaded reward model: the ref server loads it
            out.append(model_name(f))
        else:
            out.append(spec_of(f, f"reward_funcs[{i}]", "reward_funcs"))
    return out


def tool_specs(tools: Any) -> list[str]:
    return specs_of(tools, "tools", "tools")


def environment_spec(factory: Any) -> str | dict:
    """A class (or 'module:Class'), or TRL's {name: class} routed by the `environment` column."""
    if isinstance(factory, dict):
        return {k: v if isinstance(v, str) else spec_of(v, f"environment_factory[{k!r}]", "environment_factory")
                for k, v in factory.items()}
    return factory if isinstance(factory, str) else spec_of(factory, "environment_factory", "environment_factory")


def tokenizer_name(tok: Any, where: str) -> str | None:
    if tok is None or isinstance(tok, (str, Path)):
        return None if tok is None else str(tok)
    name = getattr(tok, "name_or_path", None)
    if not name:
        raise ValueError(f"GRPOTrainer: {where} has no name_or_path; save it with save_pretrained(dir) and pass dir")
    return str(name)


def check_processing_class(tok: Any, model: str) -> None:
    """Every process loads the tokenizer from the model's folder: a processing_class of that model is it."""
    name = tokenizer_name(tok, "processing_class")
    if name is not None and name != model:
        raise ValueError(f"GRPOTrainer: processing_class {name!r} is not the model's ({model!r}): every process "
                         f"loads the tokenizer from the model's folder; save it there (tokenizer.save_pretrained) "
                         f"or leave processing_class out")


# peft.LoraConfig fields that say where a config came from, not what it trains
_BOOKKEEPING = {"peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "task_type"}
_MAPPED = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
           "target_modules": "lora_target_modules"}


def lora_fields(peft_config: Any) -> dict:
    """A peft.LoraConfig -> {lora_r, lora_alpha, lora_dropout, lora_target_modules}; any other field set to
    something else than peft's default is refused by name."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig":
        raise ValueError(f"GRPOTrainer: peft_config {type(peft_config).__name__} is not supported: LoRA only "
                         f"(peft.LoraConfig)")
    default = type(peft_config)()
    task = str(getattr(peft_config.task_type, "value", peft_config.task_type))
    if peft_config.task_type is not None and task != "CAUSAL_LM":
        raise ValueError(f"GRPOTrainer: peft_config task_type {task!r}: a policy is a causal LM (CAUSAL_LM)")
    odd = sorted(k for k, v in vars(peft_config).items()
                 if k not in _BOOKKEEPING and k not in _MAPPED and v != getattr(default, k, v))
    if odd:
        raise ValueError(f"GRPOTrainer: peft_config field(s) we cannot honour: {', '.join(odd)} (LoRA here is "
                         f"lora_r, lora_alpha, lora_dropout and lora_target_modules: docs/lora.md)")
    out = {"lora_r": int(peft_config.r), "lora_alpha": float(peft_config.lora_alpha),
           "lora_dropout": float(peft_config.lora_dropout)}
    targets = peft_config.target_modules
    if isinstance(targets, str):
        raise ValueError(f"GRPOTrainer: peft_config target_modules={targets!r}: give the module names as a list "
                         f"(lora_target_modules)")
    if targets is None:  # peft picks per architecture; ours is every attention and MLP projection
        print("[api] peft_config target_modules None: LoRA on lora_target_modules' default (attention and MLP "
              "projections), not peft's per-model default", file=sys.stderr)
    else:
        out["lora_target_modules"] = sorted(targets)
    return out


def check_dataset(data: Any, where: str) -> None:
    """A datasets.Dataset / IterableDataset or a list of dicts; ValueError in one line otherwise."""
    import datasets

    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict, dict)):
        raise ValueError(f"GRPOTrainer: {where} is a dict of datasets; pass one split (e.g. ds['train'])")
    if not isinstance(data, (list, datasets.Dataset, datasets.IterableDataset)):
        raise ValueError(f"GRPOTrainer: {where} is a {type(data).__name__}; pass a datasets.Dataset, an "
                         f"IterableDataset or a list of dicts")


def write_dataset(data: Any, path: Path, where: str) -> str:
    """A datasets.Dataset / IterableDataset or a list of dicts, written once as parquet (every producer reads it)."""
    import datasets

    check_dataset(data, where)
    if isinstance(data, list):
        data = datasets.Dataset.from_list(data)
    elif isinstance(data, datasets.IterableDataset):  # read through once: a stream without end needs .take(n)
        data = datasets.Dataset.from_list(list(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    data.to_parquet(str(path))
    return str(path)
