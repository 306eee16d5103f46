"""Every TRL 1.16 GRPOConfig field (and the TrainingArguments / script arguments a GRPO user sets), what this
trainer does with it, and docs/trl.md's table made from that: common/settings/trl_fields.json is the list (data, kept
in the repository: TRL 1.16.0 is pinned, but the list is data so the table and the config never import it),
GRPOConfig + common/settings/trl_aliases.py say what happens.

    python -m common.settings.trl_table             # print the table and its counts
    python -m common.settings.trl_table --write     # rewrite docs/trl.md's generated section
    python -m common.settings.trl_table --from-trl /path/to/trl/src/trl   # regenerate trl_fields.json (once per TRL)

Each field is in one of four groups: honoured as TRL does (our name or an alias, TRL's default gives our default),
honoured with another default or reach, refused by name (with the reason; some values accepted), unknown.
tests/test_trl_table.py fails while a field is unknown or docs/trl.md's section is stale.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

from common.settings import trl_aliases

FIELDS_FILE = Path(__file__).with_name("trl_fields.json")
DOC = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
BEGIN = "<!-- trl-fields:begin (.venv/bin/python -m common.settings.trl_table --write) -->"
END = "<!-- trl-fields:end -->"
GROUPS = ("honoured as TRL does", "honoured with another default or reach", "refused by name", "unknown")

# What a honoured name does differently from TRL beyond its default (the default is compared by the code).
REACH = {
    "gradient_accumulation_steps": "accumulation only: it does not size generation (TRL's steps_per_generation)",
    "per_device_train_batch_size": "a memory knob only: the batch is num_pre_Q x Q_batch_size x train_batch_groups",
    "max_steps": "optimizer updates; -1 (TRL's default) leaves num_train_epochs or all_steps to decide",
    "num_train_epochs": "all_steps from the training set's size at start; without it (and max_steps) all_steps "
                        "1000",
    "warmup_ratio": "against the final step count, whichever source gave it",
    "use_vllm": "generation by separate genonly workers (launch.sh --workers), never colocated in the ranks",
    "vllm_importance_sampling_correction": "any engine's logprobs (HF workers too), not only vLLM's",
    "vllm_gpu_memory_utilization": "launch.sh sets it where a vLLM worker shares a GPU",
    "report_to": "metrics.jsonl is always written besides",
    "eval_steps": "greedy eval of eval_limit held-out prompts",
    "lr_scheduler_type": "constant, constant_with_warmup, linear and cosine; others refused",
    "scale_rewards": "group, batch and none (and TRL's booleans) map to advantage_mode",
    "loss_type": "vespo refused",
    "bf16": "the ranks' DeepSpeed precision; workers: worker_dtype",
    "output_dir": "",
    "save_strategy": "steps and no; epoch and best refused (a run counts steps)",
    "chat_template_kwargs": "also our chat/messages formats",
    "max_tool_calling_iterations": "",
    "log_completions": "every trained completion to output_dir/completions.jsonl, a table printed",
    "model_init_kwargs": "dtype, torch_dtype, device_map, quantization_config refused",
    "dataset_name": "a hub id, folder or file",
    "epsilon": "also the sequence-level clip (gspo_eps_low/high) when given; not given, the sequence level clips "
               "with gspo_eps_* 3e-4/4e-4 (GSPO's paper)",
    "epsilon_high": "also gspo_eps_high when given",
}


def load_fields() -> list[dict]:
    return json.loads(FIELDS_FILE.read_text())["fields"]


def _ours(name: str) -> str | None:
    """Our field a TRL name reaches (itself, or its alias's target); None where none does."""
    from common.config import GRPOConfig
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    if name in names:
        return name
    return trl_aliases.ALIASES[name][0] if name in trl_aliases.ALIASES else None


def _same_default(name: str, trl_default) -> bool:
    """Whether TRL's default, read by our loader, gives our default."""
    from common.config import GRPOConfig
    from common.settings.knobs import from_dict
    try:
        return from_dict(GRPOConfig, {name: trl_default}).validate() == GRPOConfig().validate()
    except (ValueError, TypeError):
        return False


def classify(field: dict) -> tuple[str, str]:
    """(group, what happens here) of one TRL field."""
    name = field["name"]
    ours = _ours(name)
    if ours is not None:
        where = f"`{ours}`" if ours != name else "same name"
        note = REACH.get(name, "")
        if note or not _same_default(name, field["default"]):
            from common.config import GRPOConfig
            default = GRPOConfig.__dataclass_fields__[ours]
            d = default.default if default.default is not dataclasses.MISSING else default.default_factory()
            return GROUPS[1], f"{where}, default {json.dumps(d)}" + (f"; {note}" if note else "")
        return GROUPS[0], where
    if name in trl_aliases.REFUSED:
        ok = trl_aliases.MATCHING.get(name)
        return GROUPS[2], trl_aliases.REFUSED[name] + (
            f" (accepted: {', '.join(json.dumps(v) for v in ok)})" if ok else "")
    return GROUPS[3], ""


def table() -> tuple[dict[str, int], str]:
    rows, counts = [], dict.fromkeys(GROUPS, 0)
    for f in load_fields():
        group, what = classify(f)
        counts[group] += 1
        what = what.replace("|", "\\|")
        rows.append(f"| `{f['name']}` | {f['source']} | `{json.dumps(f['default'])}` | {group} | {what} |")
    head = (f"{len(rows)} TRL 1.16 fields: **{counts[GROUPS[0]]}** honoured as TRL does, **{counts[GROUPS[1]]}** "
            f"honoured with another default or reach, **{counts[GROUPS[2]]}** refused by name, **{counts[GROUPS[3]]}**"
            f" unknown.\n\n| TRL field | from | TRL 1.16 default | here | what happens |\n"
            "| --- | --- | --- | --- | --- |")
    return counts, "\n".join([head, *rows])


def section() -> str:
    return f"{BEGIN}\n{table()[1]}\n{END}"


def write_doc(path: Path = DOC) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + section() + text[end:])


# --- regenerating the list from TRL's source (AST only: TRL is never imported) --------------------------------------
TRAINING_ARGS = {  # TrainingArguments fields a GRPO user sets, with transformers' defaults
    "output_dir": None, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8,
    "gradient_accumulation_steps": 1, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "num_train_epochs": 3.0, "max_steps": -1,
    "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "warmup_steps": 0, "logging_dir": None,
    "save_strategy": "steps", "save_steps": 500, "save_total_limit": None, "seed": 42, "fp16": False,
    "eval_strategy": "no", "eval_steps": None, "run_name": None, "report_to": "none",
    "gradient_checkpointing_kwargs": None, "optim": "adamw_torch_fused", "push_to_hub": False, "hub_model_id": None,
    "resume_from_checkpoint": None,
}
SCRIPT_ARGS = {  # `trl grpo` script and ModelConfig arguments
    "model_name_or_path": None, "model_revision": "main", "dataset_name": None, "dataset_config": None,
    "dataset_train_split": "train", "dataset_test_split": "test", "attn_implementation": None,
}


def _class_fields(path: Path, cls: str) -> list[tuple[str, object]]:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = []
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        default: object = None
        call = stmt.value
        if isinstance(call, ast.Call):
            for kw in call.keywords:
                if kw.arg == "default":
                    default = ast.literal_eval(kw.value)
                elif kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                    default = ast.literal_eval(kw.value.body)
        elif call is not None:
            default = ast.literal_eval(call)
        out.append((stmt.target.id, default))
    return out


def from_trl(src: Path, version: str) -> dict:
    fields, seen = [], set()
    for name, default in _class_fields(src / "trainer" / "grpo_config.py", "GRPOConfig"):
        fields.append({"name": name, "source": "GRPOConfig", "default": default})
        seen.add(name)
    for name, default in _class_fields(src / "trainer" / "base_config.py", "_BaseConfig"):
        if name not in seen:
            fields.append({"name": name, "source": "TRL _BaseConfig", "default": default})
            seen.add(name)
    for group, names in (("TrainingArguments", TRAINING_ARGS), ("script / ModelConfig", SCRIPT_ARGS)):
        fields += [{"name": n, "source": group, "default": d} for n, d in names.items() if n not in seen]
    return {"trl_version": version, "note": "generated by python -m common.settings.trl_table --from-trl; "
                                            "TrainingArguments defaults are transformers'", "fields": fields}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.settings.trl_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite docs/trl.md's generated section")
    p.add_argument("--from-trl", metavar="SRC", help="regenerate trl_fields.json from TRL's source folder")
    p.add_argument("--trl-version", default="1.16.0", help="the version of that source (default 1.16.0)")
    a = p.parse_args(argv)
    if a.from_trl:
        FIELDS_FILE.write_text(json.dumps(from_trl(Path(a.from_trl), a.trl_version), indent=1) + "\n")
    if a.write:
        write_doc()
    counts, text = table()
    print(text if not a.write else json.dumps(counts))


if __name__ == "__main__":
    main()
