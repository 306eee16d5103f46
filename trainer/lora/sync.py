"""Worker side of adapter-only LoRA sync into an engine: what to send so that the engine rebuilds every layer
it touches from complete, correct weights.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (its model's `packed_modules_mapping`), and
its in-place `reload_weights` rebuilds a layer from the tensors it is sent: a fused layer whose members (or
biases) were not all sent is rebuilt partly from uninitialised memory. With lora_target_modules
["q_proj", "v_proj"] the k part (and the q/k/v biases) of every `qkv_proj` would be garbage after the first
sync. So for each adapted module we also send, unchanged from the base checkpoint, every other tensor of the
engine layer it lives in: the other members of its fused group and all their biases (its own bias too).
W0 is read from the base checkpoint's safetensors (a hub id through the Hugging Face cache) and kept in the
engine's own weight dtype (bf16 for a bf16 worker: half the host memory of float32, ~13 GB instead of ~26 GB for
a 7B model's target modules); the merge upcasts one tensor at a time (adapters.py merged_tensors).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from common.paths import local_model_dir
from common.weights.delta import DELTA_FORMAT
from trainer.lora.adapters import ADAPTER_FORMAT, LoraMerger

log = logging.getLogger("trainer")


class BaseCheckpoint:
    """The base model's safetensors files: tensor names (read once, headers only) and tensors by name, cast to
    `dtype` as they are read (None: as stored)."""

    def __init__(self, model_path: str, dtype: torch.dtype | None = None, revision: str | None = None):
        from safetensors import safe_open

        self.dir, self.dtype = local_model_dir(model_path, revision), dtype  # the revision the model was loaded at
        self.files = sorted(Path(self.dir).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir} (model {model_path!r}): cannot read the "
                                    f"base weights to merge LoRA adapters into")
        self.where: dict[str, Path] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                self.where.update({k: f for k in st.keys()})

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        names = sorted(set(names))
        missing = [n for n in names if n not in self.where]
        if missing:
            raise ValueError(f"base checkpoint {self.dir} lacks the weights {missing[:5]}")
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            mine = [n for n in names if self.where[n] == f]
            if mine:
                with safe_open(str(f), framework="pt") as st:
                    out.update({n: self._cast(st.get_tensor(n)) for n in mine})
        return out

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None else t.to(self.dtype)


def checkpoint_weights(model_path: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """W0 of `names` from the base checkpoint (a local directory, or a hub id found in the HF cache)."""
    return BaseCheckpoint(model_path).read(names)


def layer_companions(merged: Iterable[str], fused: dict[str, list[str]], available: Iterable[str]) -> list[str]:
    """Every checkpoint tensor of the engine layers that the merged weights `merged` land in, other than
    those weights: for model.layers.0.self_attn.q_proj.weight with fused {"qkv_proj": [q, k, v]} that is
    k_proj.weight, v_proj.weight and the q/k/v biases of layer 0 (whichever the checkpoint has)."""
    member_of = {m: group for group in fused.values() for m in group}
    modules = set()
    for name in merged:
        module = name.rsplit(".", 1)[0]  # model.layers.0.self_attn.q_proj
        parent, _, leaf = module.rpartition(".")
        modules.update(f"{parent}.{m}" if parent else m for m in member_of.get(leaf, [leaf]))
    merged = set(merged)
    return sorted(n for n in available if n.rsplit(".", 1)[0] in modules and n not in merged)


def policy_loader(engine, model_path: str, held=None, revision: str | None = None):
    """The weight-sync `apply(tensors, metadata)` of a genonly worker: full weights go to the engine as they
    are; an adapter blob is merged into W0 and sent with its layers' companions (see the module docstring);
    a delta (only the tensors that changed) is sent with its layers' companions read from `held()`, the
    worker's full copy (common/weights/apply.py HeldWeights), the delta already applied to it."""
    merger = LoraMerger()
    state: dict = {}

    def fused() -> dict[str, list[str]]:
        if "fused" not in state:
            state["fused"] = engine.fused_modules()
        return state["fused"]

    def base() -> BaseCheckpoint:
        if "ckpt" not in state:  # first adapter sync only: a full-weight run never reads the checkpoint
            state["ckpt"] = BaseCheckpoint(model_path, dtype=engine.weight_dtype(), revision=revision)  # engine's dtype
            log.info("LoRA sync: W0 from %s, kept in %s; fused engine layers %s", state["ckpt"].dir,
                     state["ckpt"].dtype, fused() or "none")
        return state["ckpt"]

    def apply(tensors: dict, metadata: dict) -> None:
        fmt = metadata.get("format")
        if fmt == DELTA_FORMAT:
            full = held().tensors
            extra = layer_companions(tensors, fused(), full)
            engine.load_weights([*tensors.items(), *((n, full[n]) for n in extra)])
        elif fmt == ADAPTER_FORMAT:
            ckpt = base()
            first = not merger.base
            engine.load_weights(merger.merged(tensors, metadata, ckpt.read,
                                              lambda names: layer_companions(names, fused(), ckpt.where)))
            if first:
                log.info("LoRA sync: W0 of %d tensors kept for the merges, %.1f MB", len(merger.base),
                         merger.base_bytes() / 2**20)
        else:
            engine.load_weights(tensors.items())

    apply.merger = merger  # the kept W0 (this worker's extra host memory), for the log and tests
    return apply
