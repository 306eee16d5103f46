"""LoRA through PEFT: wrapping the policy, adapter checkpoints, the merged final model, adapter-only weight sync.

With lora_r > 0 the policy is a peft `PeftModel`: the base weights W0 are frozen (no gradients, no optimizer
state; the ref server keeps serving the same frozen base) and each target Linear learns W = W0 + s * B @ A with
s = lora_alpha / lora_r.

Weight sync publishes only the adapter tensors (A and B of every target module, under the base model's module
names) with safetensors metadata {"format": "lora_adapter", "lora_scaling": s}. A worker merges them into its
own copy of the base model: `LoraMerger` keeps W0 of the target modules (captured once, before the first merge)
and yields W0 + s * B @ A for them, which HF workers copy in place and engines take through load_weights.
Why merge rather than vLLM's LoRA support: merged weights make the worker run the exact dense model the
trainer's merged checkpoint is (no second LoRA kernel path whose numerics differ from the trainer's, no
max_lora_rank/target-module limits to keep in step), generation costs nothing extra per token, and the same
code serves the HF and the vLLM engine. The price is one copy of W0 for the target modules on the worker
(we re-merge from W0 each time rather than adding deltas in place, which would accumulate rounding error).
"""
from __future__ import annotations

import logging
import re
import resource
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from trainer.dist.gather import GATHER_BUCKET_BYTES, cpu_copies

log = logging.getLogger("trainer")

ADAPTER_FORMAT = "lora_adapter"
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"


def is_lora(model) -> bool:
    # a PeftModel exists only once peft was imported (wrap_lora): a run without LoRA never pays peft's import
    # (~0.2 CPU-s in each rank)
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def wrap_lora(model, cfg):
    """The policy with LoRA adapters on cfg.lora_target_modules; only the adapter parameters require grad."""
    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                    target_modules=list(cfg.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lc)
    except ValueError as e:  # peft's message when no module matches: name the knob
        raise ValueError(f"lora_target_modules {cfg.lora_target_modules} do not fit this model: {e}") from e


def lora_scaling(model) -> float:
    pc = model.peft_config[_ADAPTER]
    if getattr(pc, "use_rslora", False):
        return pc.lora_alpha / pc.r ** 0.5
    return pc.lora_alpha / pc.r


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 partitions leave p.numel() == 0


def trainable_summary(model) -> dict:
    """Trainable parameter count and fraction (correct under ZeRO-3 partitioning too)."""
    total = trainable = 0
    for p in model.parameters():
        total += _numel(p)
        trainable += _numel(p) if p.requires_grad else 0
    return {"trainable_params": trainable, "total_params": total, "trainable_fraction": trainable / max(total, 1)}


def peak_memory_mb() -> float:
    """This process's peak memory: torch.cuda.max_memory_allocated on GPU, peak RSS (ru_maxrss, KiB) on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def base_name(peft_name: str) -> str:
    """peft parameter name -> the base model's name: drops the wrapper prefix, `.base_layer` and the adapter name
    (base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight -> model.layers.0.mlp.up_proj.lora_A.weight)."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    name = name.replace(".base_layer.", ".")
    return re.sub(rf"\.(lora_[AB])\.{_ADAPTER}\.", r".\1.", name)


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def adapter_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(base-model name, tensor) of every adapter weight: what an adapter-only weight sync publishes."""
    for n, p in adapter_parameters(model):
        yield base_name(n), p.detach()


def adapter_metadata(model) -> dict[str, str]:
    return {"format": ADAPTER_FORMAT, "lora_scaling": repr(lora_scaling(model))}


def merged_tensors(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """W = W0 + scaling * B @ A for every module with an adapter (computed in float32, returned in W0's dtype).
    `base` maps the module's weight name (prefix + '.weight') to W0."""
    prefixes = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    for m in prefixes:
        a, b = adapter.get(f"{m}.lora_A.weight"), adapter.get(f"{m}.lora_B.weight")
        if a is None or b is None:
            raise ValueError(f"adapter weights for {m} need both lora_A and lora_B")
        w0 = base.get(f"{m}.weight")
        if w0 is None:
            raise ValueError(f"adapter module {m} has no base weight {m}.weight in this model")
        if tuple(w0.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {m}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit W0 {tuple(w0.shape)}")
        delta = b.to(device=w0.device, dtype=torch.float32) @ a.to(device=w0.device, dtype=torch.float32)
        yield f"{m}.weight", (w0.float() + scaling * delta).to(w0.dtype)


class LoraMerger:
    """Worker side of adapter-only sync: keeps W0 of the adapted modules and merges each new adapter into it.

    `apply(model, tensors, metadata)` is the WeightSync adapter loader for an HF model (in-place copy);
    `merged(tensors, metadata, base_lookup)` yields the (name, merged tensor) pairs for any engine's
    load_weights, with W0 from `base_lookup(names) -> {name: W0}` on the first call: tensors the merger keeps as
    they are (their own memory, in the engine's dtype: no second copy, no float32 widening)."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def merged(self, tensors: dict[str, torch.Tensor], metadata: dict, base_lookup, companions=None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """`companions(merged_names) -> names`: base tensors the engine must get along with the merged ones
        (trainer/lora/sync.py: the rest of a fused vLLM layer); they are sent unchanged, as W0."""
        if metadata.get("format") != ADAPTER_FORMAT:
            raise ValueError(f"not an adapter blob: metadata {metadata}")
        scaling = float(metadata["lora_scaling"])
        wanted = sorted({f"{k.rsplit('.lora_', 1)[0]}.weight" for k in tensors})
        extra = sorted(set(companions(wanted)) - set(wanted)) if companions is not None else []
        missing = [n for n in wanted + extra if n not in self.base]
        if missing:  # first sync (or new modules): capture W0 before anything is overwritten
            self.base.update(base_lookup(missing))
        yield from merged_tensors(self.base, tensors, scaling)
        for n in extra:
            yield n, self.base[n]

    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def apply(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], metadata: dict) -> int:
        """Copy the merged weights into the HF model in place; returns how many tensors changed."""
        params = dict(model.named_parameters())

        def lookup(names: Iterable[str]) -> dict[str, torch.Tensor]:
            unknown = [n for n in names if n not in params]
            if unknown:
                raise ValueError(f"adapter weights name modules this model lacks: {unknown[:5]}")
            return {n: params[n].detach().clone() for n in names}  # W0 before the merges overwrite it

        n = 0
        with torch.no_grad():
            for name, w in self.merged(tensors, metadata, lookup):
                params[name].copy_(w)
                n += 1
        return n


# ---------------------------------------------------------------------------------------------- checkpoints
def save_adapter(engine, tokenizer, out: Path, rank: int, zero_stage: int, budget: int = GATHER_BUCKET_BYTES) -> None:
    """adapter_config.json + adapter_model.safetensors (PeftModel.from_pretrained-loadable) and the tokenizer.
    Under ZeRO-3 the adapters are gathered `budget` bytes at a time (trainer/dist/gather.py)."""
    model = engine.module
    state = cpu_copies(adapter_parameters(model), zero_stage, rank, budget=budget)
    if rank == 0:
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        log.info("saved LoRA adapter %s", out)
    torch.distributed.barrier()


def save_merged(engine, tokenizer, out: Path, rank: int, zero_stage: int, budget: int = GATHER_BUCKET_BYTES) -> None:
    """The merged model W0 + s * B @ A as a plain HF directory (AutoModelForCausalLM-loadable), with the
    adapter itself in out/adapter. The live model is left unmerged (merge_and_unload would change it).
    Under ZeRO-3 the weights are gathered `budget` bytes at a time into rank 0's CPU copy (trainer/dist/gather.py)."""
    model = engine.module
    state = cpu_copies(model.named_parameters(), zero_stage, rank, budget=budget)
    if rank == 0:
        adapter = {base_name(n): t for n, t in state.items() if ".lora_A." in n or ".lora_B." in n}
        base = {base_name(n): t for n, t in state.items() if ".lora_" not in n}
        merged = dict(base)
        merged.update(merged_tensors(base, adapter, lora_scaling(model)))
        inner = model.get_base_model()
        if inner.config.tie_word_embeddings:  # one tensor for both names, as from_pretrained expects
            merged.pop("lm_head.weight", None)
        from safetensors.torch import save_file
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        inner.config.save_pretrained(out)
        if inner.generation_config is not None:
            inner.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        peft_state = {n: t for n, t in state.items() if ".lora_A." in n or ".lora_B." in n}
        model.save_pretrained(out / "adapter", state_dict=peft_state, safe_serialization=True)
        log.info("saved merged LoRA model %s (adapter in %s)", out, out / "adapter")
    torch.distributed.barrier()

