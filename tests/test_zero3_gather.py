"""Publishing and saving under ZeRO-3 in bounded memory (issue 30, section 2; trainer/dist/gather.py).

Two gloo ranks (torch multiprocessing), real DeepSpeed engines on the tiny model (4 layers, ~4.6 MB float32), with
every parameter partitioned (stage3_param_persistence_threshold 0) and a gather budget of 1 MiB. Every
GatheredParameters context is counted when it opens: the bytes of the model's parameters that are then whole
(ds_status AVAILABLE) must never exceed the budget. Before the fix publish, save_hf and LoRA's save_merged
gathered the whole model at once (~4.6 MB, over the budget). The published blobs and the saved files must be
byte-identical to a ZeRO-0 engine's on the same weights, and the saved directories load with from_pretrained
with the embeddings and lm_head still tied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import find_free_port

BUDGET = 1 << 20  # bytes: the tiny model goes in about five groups
WORLD = 2


def _ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _install_counter(deepspeed) -> dict:
    """Wraps deepspeed.zero.GatheredParameters (which every ZeRO-3 gather in the trainer goes through): on each
    entry, the bytes of the watched model's parameters that are whole at that moment."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    seen = {"model": None, "held": []}
    base = deepspeed.zero.GatheredParameters

    class Counting(base):
        def __enter__(self):
            out = super().__enter__()
            if seen["model"] is not None:
                seen["held"].append(sum(p.ds_numel * p.element_size() for p in seen["model"].parameters()
                                        if p.ds_status == ZeroParamStatus.AVAILABLE))
            return out

    deepspeed.zero.GatheredParameters = Counting
    return seen


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from test_lora import lora_policy
    from transformers import AutoTokenizer

    from common.config import GRPOConfig
    from common.modeling import load_model
    from trainer.checkpoint import save_hf
    from trainer.deepspeed_policy import init_deepspeed, initialize
    from trainer.publish import Publisher

    deepspeed, *_ = init_deepspeed(GRPOConfig(dist_timeout=120))
    seen = _install_counter(deepspeed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = Path(out)
    held = {}

    def run(name, stage, fn, *args, **kw):
        seen["held"] = []
        fn(*args, **kw)
        held[f"{name}{stage}"] = seen["held"]

    def publish(engine, stage, sync_dir, **over):
        cfg = GRPOConfig(num_gen_workers=1, sync_steps=1, sync_dir=str(out / sync_dir), **over)
        Publisher(cfg, None, engine.module, deepspeed, rank, stage, BUDGET).publish(1)

    for stage in (0, 3):
        model = load_model(model_dir, device="cpu", dtype="float32", trainable=True)
        eng, *_ = initialize(deepspeed, _ds_config(stage), model=model, model_parameters=list(model.parameters()))
        seen["model"] = eng.module
        run("publish", stage, publish, eng, stage, f"sync{stage}", worker_dtype="bfloat16")
        run("save_bf16_", stage, save_hf, eng, tok, out / f"hf_bf16_{stage}", rank, stage, torch.bfloat16,
            budget=BUDGET)
        run("save_", stage, save_hf, eng, tok, out / f"hf_{stage}", rank, stage, budget=BUDGET)

        torch.manual_seed(3)  # peft draws lora_A at random: the same A for both stages, on both ranks
        lora = lora_policy(model_dir, seed=3)
        leng, *_ = initialize(deepspeed, _ds_config(stage), model=lora,
                              model_parameters=[p for p in lora.parameters() if p.requires_grad])
        seen["model"] = leng.module
        run("lora_publish", stage, publish, leng, stage, f"lora_sync{stage}")
        run("lora_adapter", stage, save_hf, leng, tok, out / f"lora_adapter{stage}", rank, stage, budget=BUDGET)
        run("lora_merged", stage, save_hf, leng, tok, out / f"lora_merged{stage}", rank, stage, final=True,
            budget=BUDGET)
        seen["model"] = None
    (out / f"held{rank}.json").write_text(json.dumps(held))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1 CPU-s a rank)
    exit_cleanly(0)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("zero3_gather")
    mp.spawn(_rank, args=(find_free_port(), str(tiny_model_dir), str(out)), nprocs=WORLD, join=True)
    return out, [json.loads((out / f"held{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # two real ranks (torch multiprocessing)
def test_zero3_gathers_one_bounded_group_at_a_time(runs):
    out, held = runs
    assert held[0] == held[1]  # the same gathers on both ranks, in the same order (collectives)
    model_bytes = sum(t.numel() * t.element_size() for t in _tensors(out / "hf_0").values())
    assert model_bytes > 4 * BUDGET  # several groups' worth, or the bound proves nothing
    for name in ("publish", "save_bf16_", "save_", "lora_merged"):
        assert held[0][f"{name}0"] == []  # ZeRO-0: nothing to gather
        got = held[0][f"{name}3"]
        assert len(got) >= 4, (name, got)
        assert 0 < max(got) <= BUDGET, f"{name}: {max(got)} bytes gathered at once, budget {BUDGET}"
    for name in ("lora_publish", "lora_adapter"):  # the adapters alone: a few hundred KB, one group
        assert 0 < max(held[0][f"{name}3"]) <= BUDGET


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(d / "model.safetensors"))


def _same_files(a: Path, b: Path, name: str) -> None:
    assert (a / name).read_bytes() == (b / name).read_bytes(), f"{a / name} differs from {b / name}"


@pytest.mark.slow  # two real ranks (torch multiprocessing)
def test_published_blobs_equal_zero0(runs):
    out, _ = runs
    for sync in ("sync", "lora_sync"):
        _same_files(out / f"{sync}0", out / f"{sync}3", "policy-v1.safetensors")
    from common.weights.blob import blob_metadata
    blob = (out / "sync3" / "policy-v1.safetensors").read_bytes()
    assert blob_metadata(blob)["format"] == "pt" and b'"BF16"' in blob[:4096]


@pytest.mark.slow  # two real ranks (torch multiprocessing)
def test_saved_checkpoints_equal_zero0_and_load_tied(runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out, _ = runs
    for d in ("hf_bf16_", "hf_", "lora_merged"):
        _same_files(out / f"{d}0", out / f"{d}3", "model.safetensors")
    _same_files(out / "lora_adapter0", out / "lora_adapter3", "adapter_model.safetensors")
    _same_files(out / "lora_merged0" / "adapter", out / "lora_merged3" / "adapter", "adapter_model.safetensors")
    source = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for d, dtype in (("hf_3", torch.float32), ("hf_bf16_3", torch.bfloat16), ("lora_merged3", torch.float32)):
        m = AutoModelForCausalLM.from_pretrained(str(out / d))
        assert m.dtype == dtype and m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr(), d
        assert "lm_head.weight" not in _tensors(out / d), d  # written once, as from the live model
        if d != "lora_merged3":  # the engines' weights are the source's, cast to the save dtype
            for (n, p), q in zip(m.named_parameters(), source.parameters()):
                assert torch.equal(p, q.to(dtype)), (d, n)


def test_groups_keep_to_the_budget_and_tied_names_share_one_copy():
    from trainer.dist.gather import cpu_copies, groups

    ps = [torch.nn.Parameter(torch.full((n,), float(i))) for i, n in enumerate((100, 100, 300, 50, 50))]
    got = [[n for n, _ in g] for g in groups([(f"p{i}", p) for i, p in enumerate(ps)], budget=800)]  # float32 bytes
    assert got == [["p0", "p1"], ["p2"], ["p3", "p4"]]  # 400 + 400; 1200 over the budget alone; 200 + 200
    named = [("embed", ps[0]), ("mid", ps[2]), ("lm_head", ps[0])]  # named_parameters(remove_duplicate=False)
    copies = cpu_copies(named, zero_stage=0, rank=0, dtype=torch.bfloat16, budget=800)
    assert list(copies) == ["embed", "mid", "lm_head"] and copies["embed"] is copies["lm_head"]
    assert copies["mid"].dtype == torch.bfloat16 and copies["mid"].data_ptr() != ps[2].data_ptr()
    assert cpu_copies(named, zero_stage=0, rank=1) is None
