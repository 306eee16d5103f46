"""The GPU memory estimate (common/placement/memory_plan.py, docs/gpus.md): the Qwen2.5-7B shape against a hand
computation; `launch.sh train --print-plan` with a fake `nvidia-smi` reporting 80 GB and 24 GB GPUs (a fit and a
no-fit verdict, micro_batch_size/gradient_checkpointing picked where unset) and one whose memory query fails (the
estimate, no verdict); on CPU nothing changes (unset = the whole batch, no checkpointing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from common.config import GRPOConfig
from common.placement.memory_plan import (
    FIT_SHARE,
    GIB,
    KEPT_LOGITS_BYTES,
    ModelShape,
    TrainSettings,
    activation_bytes,
    hf_worker_parts,
    kv_cache_bytes,
    pick,
    rank_parts,
    ref_parts,
)

QWEN7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
          "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064, "num_attention_heads": 28,
          "num_key_value_heads": 4, "tie_word_embeddings": False, "max_position_embeddings": 32768,
          "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


@pytest.fixture
def qwen7b(tmp_path):
    d = tmp_path / "qwen7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN7B))  # the shape only: no weights are loaded
    return d


def test_qwen7b_parameters_and_rank_memory_match_a_hand_computation(qwen7b):
    shape = ModelShape.from_config(str(qwen7b))
    h, L, inter, V, kv = 3584, 28, 18944, 152064, 4 * 128
    # by hand: embeddings and untied head, per layer q/k/v (with Qwen2's bias), o, gate/up/down, 2 norms; final norm
    n = 2 * V * h + L * (h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h) + h
    assert shape.params() == n
    assert abs(n - 7.6156e9) / 7.6156e9 < 0.001  # Qwen2.5-7B's published count: 7.62 B
    # ZeRO paper, bf16 + Adam: 2 (weights) + 2 (grads) + 12 (fp32 master, m, v) bytes a parameter; ZeRO-3 over 8
    # ranks partitions all of them; the step's fp32 gradient partition adds 4/8. Activations per token and layer
    # (bf16): q, k and v repeated to 28 heads, attention output, o_proj's input (5 x 3584); gate, SiLU, up, product
    # (4 x 18944); 2 RMSNorms keeping input and output (bf16) and two fp32 copies (2 x 12 x 3584 bytes).
    tokens = 2 * 1024
    act = tokens * L * (2 * (5 * h + 4 * inter) + 2 * 12 * h)
    logits = 1024 * V * 16  # one 1024-position chunk: bf16 + fp32 logits, exp, their gradients
    s = TrainSettings(world=8, stage=3, bf16=True, micro_rows=2, seq_len=1024, completion_len=512,
                      checkpointing=False, chunk_tokens=1024)
    parts = rank_parts(shape, s)
    assert abs(parts["weights"] + parts["gradients"] + parts["optimizer"] - 16 * n / 8) / (16 * n / 8) < 0.01
    assert 0.9 < parts["activations"] / (act + logits) < 1.1, parts
    # gradient checkpointing keeps one bf16 hidden state per token and layer, plus one layer recomputed
    gc = activation_bytes(shape, TrainSettings(**{**s.__dict__, "checkpointing": True}))
    assert 0.9 < gc / (tokens * L * 2 * h + act / L + logits) < 1.1
    # ... where the step is the larger transient: the fp32 gradient partition, Adam's sqrt(v) and a bf16 gradient
    # copy (measured on CPU), 4 + 4 + 2 bytes / 8 ranks
    assert rank_parts(shape, TrainSettings(**{**s.__dict__, "checkpointing": True}))["optimizer_step"] == n * 10 // 8
    assert parts["activations"] / GIB == pytest.approx(17.3, abs=0.5)  # 2 rows x 1024 tokens of a 7B: 17 GiB


def test_an_hf_worker_counts_its_logprob_forward_as_the_gpu_run_measured():
    """The first GPU run (H200, docs/benchmarks.md): an HF worker of the 0.5B shape (bf16, 8 samples, 512 + 128
    tokens) held 3.3 GiB; its KV cache alone gave 1.6 with the context. After generate it computes the behaviour
    logprobs of the group with the ref server's inference forward (trainer/rollout.py policy_logps)."""
    shape = ModelShape._from_dict({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                                   "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                                   "vocab_size": 151936, "tie_word_embeddings": True})
    with_fwd = hf_worker_parts(shape, 2, 8, 640, group_rows=8, completion_len=128, chunk_tokens=1024)
    fwd = ref_parts(shape, 2, 8, 640, 128, 1024)["activations"]
    assert with_fwd == {"weights": shape.params() * 2, "logprob_forward": fwd}
    assert (sum(with_fwd.values()) + GIB // 2) / GIB == pytest.approx(3.3, abs=0.25)  # measured 3,346 MiB
    no_logps = hf_worker_parts(shape, 2, 8, 640)  # compute_gen_logps false: generate's KV cache only
    assert no_logps == {"weights": shape.params() * 2, "kv_cache": kv_cache_bytes(shape, 2, 8, 640)}
    big_call = hf_worker_parts(shape, 2, 4096, 640, group_rows=8, completion_len=128, chunk_tokens=1024)
    assert set(big_call) == {"weights", "kv_cache"}  # a large generate call's cache outgrows one group's forward


def test_an_hf_worker_whose_logits_fit_counts_them_and_no_forward():
    """Issue 62: where a call's float32 logits fit in KEPT_LOGITS_BYTES the HF engine takes the logprobs from them
    (trainer/engines/hf.py reads the same bound), so the worker holds its KV cache and those logits, no forward."""
    from trainer.engines import hf
    assert hf.LOGITS_BYTES == KEPT_LOGITS_BYTES
    tiny = ModelShape._from_dict({"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512,
                                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                                  "vocab_size": 774, "tie_word_embeddings": True})
    parts = hf_worker_parts(tiny, 4, 64, 160, group_rows=8, completion_len=32, chunk_tokens=1024)
    assert parts == {"weights": tiny.params() * 4, "kv_cache": kv_cache_bytes(tiny, 4, 64, 160),
                     "kept_logits": 64 * 32 * 774 * 4}
    no_logps = hf_worker_parts(tiny, 4, 64, 160)  # compute_gen_logps false: no logits kept either
    assert no_logps == {"weights": tiny.params() * 4, "kv_cache": kv_cache_bytes(tiny, 4, 64, 160)}


LLAMA = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
         "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True}


@pytest.mark.parametrize("config", [
    QWEN7B, LLAMA, dict(LLAMA, head_dim=128, attention_bias=True), dict(QWEN7B, attention_bias=False),
    {k: v for k, v in QWEN7B.items() if k != "num_key_value_heads"},  # Qwen2Config's default (32), not the heads
    {k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"},
    dict(LLAMA, model_type="mistral"),
], ids=["qwen7b", "llama", "llama_head_dim_bias", "qwen_no_bias", "qwen_no_kv_heads", "llama_no_tie", "mistral"])
def test_config_json_read_directly_gives_the_shape_autoconfig_gives(tmp_path, config):
    """from_config reads a complete qwen2/llama config.json without transformers (launch.sh's plan on a GPU node
    then imports neither torch nor transformers); where a field is missing it asks AutoConfig for the class default."""
    from transformers import AutoConfig
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = AutoConfig.from_pretrained(tmp_path)
    heads = c.num_attention_heads
    want = ModelShape(hidden=c.hidden_size, layers=c.num_hidden_layers, intermediate=c.intermediate_size,
                      vocab=c.vocab_size, heads=heads, kv_heads=c.num_key_value_heads or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, tied=c.tie_word_embeddings,
                      qkv_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")))
    assert ModelShape.from_config(str(tmp_path)) == want
    direct = ModelShape._from_json(tmp_path / "config.json")
    complete = config.get("model_type") in ("qwen2", "llama") and "num_key_value_heads" in config \
        and "tie_word_embeddings" in config
    assert (direct == want) if complete else direct is None


def test_the_tiny_models_shape_is_read_directly():
    from common.tiny_model import ensure_tiny_model
    assert ModelShape._from_json(ensure_tiny_model() / "config.json") is not None


def test_a_gpu_plan_of_a_local_model_imports_neither_torch_nor_transformers(tmp_path, qwen7b):
    code = ("import sys; from common.placement.launch_plan import main; "
            f"rc = main(['--workers', '1', '--', '--model', {str(qwen7b)!r}]); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
            "assert rc == 0 and not bad, bad[:5]")
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{fake_smi(tmp_path, 8, 81559)}:/usr/bin:/bin")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "7.62 B parameters" in proc.stderr and "picked (left unset): micro_batch_size 4" in proc.stderr


def test_pick_prefers_no_checkpointing_and_respects_what_the_user_set(qwen7b):
    shape = ModelShape.from_config(str(qwen7b))
    base = TrainSettings(world=6, stage=2, bf16=True, micro_rows=8, seq_len=1024, completion_len=512,
                         checkpointing=False, chunk_tokens=1024)
    fits = lambda budget: lambda m, gc: sum(rank_parts(shape, TrainSettings(  # noqa: E731
        **{**base.__dict__, "micro_rows": m, "checkpointing": gc})).values()) <= budget
    assert pick(fits(FIT_SHARE * 80 * GIB), 8, None, None) == (4, False)  # 8 rows = 61 GiB of activations: no
    assert pick(fits(FIT_SHARE * 80 * GIB), 8, 8, None) == (8, True)  # the user's micro-batch stays
    assert pick(fits(FIT_SHARE * 80 * GIB), 8, None, True) == (8, True)
    assert pick(fits(FIT_SHARE * 24 * GIB), 8, None, None) is None  # 7B with Adam over 6 ranks on 24 GB
    # the order: the largest micro-batch without checkpointing, then with it (halving from the whole batch)
    assert pick(lambda m, gc: m <= (8 if gc else 2), 8, None, None) == (2, False)
    assert pick(lambda m, gc: gc and m <= 4, 8, None, None) == (4, True)
    assert pick(lambda m, gc: gc and m <= 4, 8, 0, None) is None  # 0 = the whole batch, as the user asked


# ------------------------------------------------------------------------------ launch.sh train --print-plan
def fake_smi(tmp_path, n: int, mib: int | None):
    """`nvidia-smi -L` lists n GPUs; the memory query prints mib per GPU (None: it fails, as the old fake)."""
    d = tmp_path / f"bin{n}-{mib}"
    d.mkdir(exist_ok=True)
    listing = "".join(f'echo "GPU {i}: NVIDIA Fake (UUID: GPU-{i:08d})"\n' for i in range(n))
    query = "".join(f"echo {mib}\n" for _ in range(n)) if mib else "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"
    (d / "nvidia-smi").write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then\n{listing}exit 0\nfi\n'
                                  f'[ "$1" = "--query-gpu=memory.total" ] || exit 9\n{query}')
    (d / "nvidia-smi").chmod(0o755)
    return d


def print_plan(tmp_path, n: int, mib: int | None, *args: str) -> subprocess.CompletedProcess:
    # GRPO_PYTHON: no scripts/setup.sh, which would see the fake GPU and install CUDA torch on a stale stamp
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{fake_smi(tmp_path, n, mib)}:{os.environ['PATH']}",
                         GRPO_PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["bash", str(REPO / "launch.sh"), "train", "--print-plan", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_print_plan_fits_a_7b_on_80gb_gpus_and_picks_the_micro_batch(tmp_path, qwen7b):
    proc = print_plan(tmp_path, 8, 81559, "--workers", "1", "--", "--model", str(qwen7b), "--gen_backend", "vllm")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "memory estimate" in err and "7.62 B parameters" in err and "ZeRO-2 over 6 rank(s)" in err
    ranks = next(line for line in err.splitlines() if "(each rank)" in line)
    assert "GPU 0: 79.6 GiB: fits" in ranks and "weights 14.2" in ranks
    # vllm_gpu_memory_utilization auto: 0.9 of a GPU of its own
    assert "worker0    vLLM reserves 0.9 x the GPU = 71.7 GiB" in err and "ref_server weights 14.2" in err
    assert "would NOT fit" not in err
    # left unset: picked, and handed to the trainer (the whole batch of 8 rows would need 61 GiB of activations)
    assert "trainer: deepspeed --include localhost:0,1,2,3,4,5 --micro_batch_size 4 --gradient_checkpointing " \
           "false" in proc.stdout.splitlines()
    mine = print_plan(tmp_path, 8, 81559, "--workers", "1", "--", "--model", str(qwen7b), "--micro_batch_size",
                      "2", "--gradient_checkpointing", "true")
    assert mine.returncode == 0, mine.stderr
    assert "trainer: deepspeed --include localhost:0,1,2,3,4,5" in mine.stdout.splitlines()  # the user's stay
    assert "micro-batch 2 of 8 rows x 1024 tokens, gradient checkpointing on" in mine.stderr


def test_print_plan_on_24gb_gpus_says_what_would_not_fit_and_refuses(tmp_path, qwen7b):
    proc = print_plan(tmp_path, 4, 24564, "--workers", "1", "--", "--model", str(qwen7b), "--gen_backend", "vllm",
                      "--vllm_gpu_memory_utilization", "0.5")  # auto gives a GPU of its own 0.9: weights fit that
    assert proc.returncode == 2 and not proc.stdout
    ranks = next(line for line in proc.stderr.splitlines() if "(each rank)" in line)
    assert "GPU 0: 24.0 GiB: would NOT fit" in ranks
    assert "its weights do not fit in its fraction, it would NOT start" in proc.stderr  # vLLM 0.5 x 24 GB < 14 GiB
    assert "ref_server weights 14.2 + activations 2.7 + cuda_context 0.5 = 17.4 GiB; GPU 3: 24.0 GiB: fits" \
           in proc.stderr
    assert "memory: the ranks need 101.0 GiB each even at micro_batch_size 1 with gradient checkpointing" \
           in proc.stderr and "GPU 0 leaves them 21.6 GiB" in proc.stderr
    explicit = print_plan(tmp_path, 4, 24564, "--workers", "1", "--", "--model", str(qwen7b),
                          "--micro_batch_size", "1", "--gradient_checkpointing", "true")
    assert explicit.returncode == 0 and "WARNING: by this estimate the ranks would not fit" in explicit.stderr


def test_print_plan_without_gpu_memory_prints_the_estimate_without_a_verdict(tmp_path, qwen7b):
    proc = print_plan(tmp_path, 4, None, "--workers", "1", "--", "--model", str(qwen7b))
    assert proc.returncode == 0, proc.stderr
    assert "memory estimate" in proc.stderr and "(each rank)" in proc.stderr
    assert "fits" not in proc.stderr and "NOT fit" not in proc.stderr
    assert "no fit verdict: GPU memory unknown (`nvidia-smi --query-gpu=memory.total --format=csv,noheader," \
           "nounits` failed (exit 9: NVIDIA-SMI has failed))" in proc.stderr
    assert "the ranks pick micro_batch_size and gradient_checkpointing at start" in proc.stderr
    assert "trainer: deepspeed --include localhost:0,1" in proc.stdout.splitlines()  # nothing picked here


def test_cpu_keeps_the_whole_batch_and_no_checkpointing(tmp_path):
    from trainer.deepspeed_policy import ds_config_for, prepare_policy
    from trainer.memory_defaults import resolve_memory_defaults
    cfg = GRPOConfig(num_pre_Q=8, train_batch_groups=2).validate()
    assert cfg.micro_batch_size is None and cfg.gradient_checkpointing is None
    ds = ds_config_for(cfg, on_gpu=False)
    assert ds["train_micro_batch_size_per_gpu"] == 16 and ds["gradient_accumulation_steps"] == 1
    resolve_memory_defaults(cfg, ds, "tiny", on_gpu=False)
    assert cfg.micro_batch_size is None and cfg.gradient_checkpointing is None
    from common.modeling import load_model
    model = prepare_policy(load_model("tiny", trainable=True), cfg)
    assert not model.is_gradient_checkpointing
    cpu = print_plan(tmp_path, 0, None, "--workers", "1")
    assert cpu.returncode == 0 and "memory estimate" not in cpu.stderr  # the CPU plan prints no estimate
