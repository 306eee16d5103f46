"""How every process loads the model: trust_remote_code, attn_implementation, revision and TRL's
model_init_kwargs, declared once and shared by GRPOConfig (ranks, workers, eval) and ServerConfig (the ref
server), so that each process that calls from_pretrained passes the same options.

    load_model(path, ..., options=cfg.load_options())        # common/modeling.py
    load_tokenizer(path, options=cfg.load_options())

No torch here: config classes import this for --help and validation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.settings.knobs import knob

# from_pretrained arguments we decide ourselves, refused in model_init_kwargs with where they are set
OWNED = {
    "dtype": "precision is bf16 / ds_config for the ranks, worker_dtype for the workers, the ref server's dtype",
    "torch_dtype": "precision is bf16 / ds_config for the ranks, worker_dtype for the workers, the ref server's "
                   "dtype",
    "device_map": "placement is launch.sh's (common/placement/plan.py): every process gets its own device",
    "quantization_config": "quantized training is not supported",
}
NAMED = ("trust_remote_code", "attn_implementation", "revision")  # fields of their own, also accepted inside
TOKENIZER_KEYS = ("trust_remote_code", "revision")  # what AutoTokenizer / AutoConfig / GenerationConfig take


@dataclass
class ModelLoading:
    trust_remote_code: bool = knob(False, "TRL name: allow model and tokenizer code shipped with the checkpoint "
                                          "(auto_map). Every process that loads the model passes it: ranks, genonly "
                                          "workers (HF and vLLM), the ref server and eval.")
    attn_implementation: str | None = knob(None, "TRL name (ModelConfig): from_pretrained's attention kernel: "
                                                 "eager, sdpa, flash_attention_2, ... null = transformers' choice. "
                                                 "vLLM workers use vLLM's own attention backend.")
    revision: str | None = knob(None, "Hub revision (branch, tag or commit) of the model, its tokenizer and the "
                                      "reference model (TRL: model_init_kwargs revision). null = the default branch.")
    model_init_kwargs: dict | None = knob(None, "TRL name: more from_pretrained keyword arguments for the model, "
                                                "a JSON object, e.g. {\"use_cache\": false}. It may also hold "
                                                "trust_remote_code, attn_implementation and revision (as TRL's does; "
                                                "one set differently by its own field is an error). dtype, "
                                                "torch_dtype, device_map and quantization_config are refused "
                                                "(precision and placement are set elsewhere).")

    def load_options(self) -> dict[str, Any]:
        """The from_pretrained keyword arguments of the model: model_init_kwargs with the named fields."""
        out = dict(self.model_init_kwargs or {})
        # always said: unset, transformers asks on stdin (and waits) before running a checkpoint's code
        out["trust_remote_code"] = bool(self.trust_remote_code or out.get("trust_remote_code", False))
        for name in ("attn_implementation", "revision"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def cli_args(self) -> list[str]:
        """These options as flags for another process that loads the model (the ref server started by
        launch.sh: common/placement/launch_plan.py); only the ones set."""
        out: list[str] = ["--trust_remote_code", "true"] if self.trust_remote_code else []
        for name in ("attn_implementation", "revision"):
            if getattr(self, name) is not None:
                out += [f"--{name}", getattr(self, name)]
        if self.model_init_kwargs:
            out += ["--model_init_kwargs", json.dumps(self.model_init_kwargs)]
        return out

    def loading_checks(self) -> list[tuple[bool, str]]:
        kw = self.model_init_kwargs or {}
        owned = sorted(k for k in kw if k in OWNED)
        mine = {"trust_remote_code": self.trust_remote_code or None, "attn_implementation": self.attn_implementation,
                "revision": self.revision}
        clash = sorted(k for k in NAMED if k in kw and mine[k] is not None and kw[k] != mine[k])
        return [
            (not owned, "model_init_kwargs may not set " + "; ".join(f"{k} ({OWNED[k]})" for k in owned)),
            (not clash, "model_init_kwargs sets " + ", ".join(f"{k}={kw.get(k)!r}" for k in clash)
             + " but the option of that name says " + ", ".join(f"{mine[k]!r}" for k in clash) + ": give one"),
            (isinstance(kw.get("trust_remote_code", False), bool), "model_init_kwargs trust_remote_code must be "
                                                                   "true or false"),
        ]


def tokenizer_options(options: dict | None) -> dict[str, Any]:
    """The part of the model's options that tokenizers and configs take (trust_remote_code, revision)."""
    return {k: v for k, v in (options or {}).items() if k in TOKENIZER_KEYS}
