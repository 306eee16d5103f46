"""Reward models (TRL 1.16's model entries of reward_funcs): which reward_fns entries are models, what they are named,
and how the ref server is told to hold them. A mixin of GRPOConfig: the fields reward_processing_classes and
reward_model_timeout, and the rules.

A reward_fns entry is a reward model when it is
  - an existing directory holding a config.json (a relative path is taken from the folder launch.sh ran in), or
  - a hub id `org/name` (one slash, no ':' nor '.py') that is not an importable module.
It is named as TRL names it: `config._name_or_path.split("/")[-1]`, i.e. the last part of the entry as written.
The model itself is loaded only by the ref server (ref_server/reward_models.py), which scores batches of
completions for every producer (trainer/rewards/models.py is the client). No torch here.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from common.settings.knobs import knob

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, a bad name: not a module
        return False


def reward_model_path(spec: str) -> str | None:
    """The model a reward_fns entry names (an absolute directory, or the hub id), or None for a reward function."""
    from common.user_code import user_dir

    spec = str(spec).strip()
    if ":" in spec or spec.endswith(".py"):
        return None
    folder = Path(spec).expanduser()
    folder = folder if folder.is_absolute() else user_dir() / folder
    if folder.is_dir() and (folder / "config.json").is_file():
        return str(folder.resolve())
    if HUB_ID.fullmatch(spec) and not Path(spec).exists() and not _importable(spec.replace("/", ".")):
        return spec
    return None


def reward_model_name(spec: str) -> str:
    """TRL's name: config._name_or_path (the string from_pretrained was given) split on '/', last part."""
    return str(spec).strip().rstrip("/").split("/")[-1]


def config_refusal(path: str, name: str) -> str | None:
    """One line when a local reward model's config.json is not a one-label sequence classifier (no weights read);
    None when it is, or when the model is a hub id (the ref server's start-up checks it)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        c = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        return f"reward model {name!r} ({path}): cannot read config.json ({e})"
    archs = c.get("architectures") or []
    labels = len(c["id2label"]) if isinstance(c.get("id2label"), dict) else c.get("num_labels", 2)
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (f"reward model {name!r} ({path}): config.json architectures {archs} has no *ForSequenceClassification "
                f"(TRL loads reward models with AutoModelForSequenceClassification, num_labels=1)")
    if labels != 1:
        return f"reward model {name!r} ({path}): config.json has {labels} labels, a reward model needs num_labels=1"
    return None


def describe_config(path: str) -> str:
    """What config.json says, for launch.sh check: `Qwen2ForSequenceClassification, 1 label, 4 layers x 64`."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return "a hub id: read by the ref server at its start"
    c = json.loads(cfg_file.read_text())
    c = c.get("text_config") or c
    return (f"{', '.join(c.get('architectures') or [])}, 1 label, {c.get('num_hidden_layers', '?')} layers x "
            f"{c.get('hidden_size', '?')}")


@dataclass
class RewardModels:
    reward_processing_classes: list | None = knob(None, "TRL name: one tokenizer per reward_fns entry (a path or hub "
                                                        "id, or null = the reward model's own), used by reward "
                                                        "models only (docs/reward_models.md).")
    reward_model_timeout: float = knob(120.0, "Seconds one group of completions may take to be scored by a reward "
                                              "model in the ref server (a round's request gets this per group); "
                                              "past it the run stops, naming the model.")

    def reward_models(self) -> list[dict]:
        """[{index, spec, path, name, tokenizer}] for the reward_fns entries that are reward models, in order."""
        specs = self.reward_specs()
        toks = list(self.reward_processing_classes or [None] * len(specs))
        out = []
        for i, spec in enumerate(specs):
            path = reward_model_path(spec)
            if path is not None:
                tok = toks[i] if i < len(toks) else None
                if tok is not None:  # a local tokenizer folder: absolute for the ref server (another cwd)
                    from common.user_code import user_dir
                    local = user_dir() / Path(str(tok)).expanduser()
                    tok = str(local.resolve()) if local.is_dir() else str(tok)
                out.append({"index": i, "spec": spec, "path": path, "name": reward_model_name(spec),
                            "tokenizer": tok})
        return out

    def reward_model_errors(self) -> list[str]:
        """One line per problem: reward_processing_classes misaligned, a config.json that is no reward model, two
        models of one name."""
        if self.reward_fns is None and self.reward_processing_classes is None:
            return []  # the defaults (or an environment's reward): no model, and no environment import here
        errors = []
        toks = self.reward_processing_classes
        if toks is not None:
            n = len(self.reward_specs())
            if not isinstance(toks, list) or len(toks) != n:
                return [f"reward_processing_classes must be a list with one entry (a tokenizer path or null) per "
                        f"reward_fns entry ({n}), got {toks!r}"]
        models = self.reward_models()
        names = [m["name"] for m in models]
        for m in models:
            if names.count(m["name"]) > 1:
                return [f"two reward models are named {m['name']!r} (TRL names them by the last part of the path)"]
            why = config_refusal(m["path"], m["name"])
            if why:
                errors.append(why)
        if toks is not None and any(t is not None for i, t in enumerate(toks)
                                    if i not in {m["index"] for m in models}):
            errors.append("reward_processing_classes names a tokenizer for an entry that is a reward function, "
                          "not a reward model")
        if self.reward_model_timeout <= 0:
            errors.append("reward_model_timeout must be > 0")
        return errors

    def reward_model_server_args(self) -> list[str]:
        """The ref server's --reward_models flag (launch.sh passes it: common/placement/launch_plan.py); [] if none."""
        models = [{"path": m["path"], "name": m["name"], "tokenizer": m["tokenizer"]} for m in self.reward_models()]
        return ["--reward_models", json.dumps(models)] if models else []
