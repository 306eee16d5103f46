"""Issue 42: one resolver of the generation settings per device (common/settings/gen_defaults.py), `auto` on the
command line and in a config file, and the engines' per-prompt token budgets (tool rounds)."""
from __future__ import annotations

import json

import pytest

from common.config import GRPOConfig
from common.settings.gen_defaults import resolve_generation, unresolved
from common.settings.knobs import load_config


def test_auto_is_the_default_and_a_value_on_the_command_line_or_in_a_file(tmp_path):
    cfg = load_config(GRPOConfig, [])
    assert unresolved(cfg) == ["Q_batch_size", "gen_batch_size", "vllm_eager", "vllm_gpu_memory_utilization"]
    assert cfg.vllm_enable_prefix_caching is True
    (tmp_path / "c.json").write_text(json.dumps({"Q_batch_size": 4, "vllm_eager": "auto"}))
    cfg = load_config(GRPOConfig, ["--config", str(tmp_path / "c.json"), "--vllm_gpu_memory_utilization", "0.6"])
    assert (cfg.Q_batch_size, cfg.vllm_eager, cfg.vllm_gpu_memory_utilization) == (4, "auto", 0.6)
    with pytest.raises(SystemExit):
        load_config(GRPOConfig, ["--Q_batch_size", "many"])
    (tmp_path / "bad.json").write_text(json.dumps({"vllm_eager": "sometimes"}))
    with pytest.raises(ValueError, match="vllm_eager.*bool or 'auto'"):
        load_config(GRPOConfig, ["--config", str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match="Q_batch_size must be >= 1"):
        load_config(GRPOConfig, ["--Q_batch_size", "0"])


def test_cuda_fills_the_gpu_cpu_keeps_what_the_bench_measured():
    cfg = GRPOConfig(train_batch_groups=32)
    gpu, lines = resolve_generation(cfg, cuda=True, producer="worker", ranks=2, workers=1)
    assert (gpu.vllm_eager, gpu.vllm_enable_prefix_caching, gpu.vllm_gpu_memory_utilization) == (False, True, 0.9)
    assert gpu.Q_batch_size == 64 and gpu.gen_batch_size == 64 * 8  # a whole step of 2 ranks x 32 groups
    assert any(line.startswith("vllm_eager False") for line in lines)
    shared, _ = resolve_generation(cfg, cuda=True, gpu_share=0.15)
    assert shared.vllm_gpu_memory_utilization == 0.15
    small, _ = resolve_generation(GRPOConfig(train_batch_groups=16, max_staleness=4), cuda=True, producer="rank")
    assert small.Q_batch_size == 32  # 16 groups are 128 sequences: raised to 256 / num_pre_Q
    capped, _ = resolve_generation(GRPOConfig(), cuda=True, producer="rank")
    assert capped.Q_batch_size == 3  # more than max_staleness + 1 steps would be dropped as stale
    unsynced, _ = resolve_generation(GRPOConfig(sync_steps=0), cuda=True, producer="rank")
    assert unsynced.Q_batch_size == 32
    cpu, _ = resolve_generation(GRPOConfig(train_batch_groups=4), cuda=False, producer="worker", ranks=2, workers=2)
    assert (cpu.vllm_eager, cpu.vllm_enable_prefix_caching, cpu.Q_batch_size, cpu.gen_batch_size) == (True, True, 4, 64)
    mine, _ = resolve_generation(GRPOConfig(Q_batch_size=3, vllm_eager=True, gen_batch_size=7), cuda=True)
    assert (mine.Q_batch_size, mine.vllm_eager, mine.gen_batch_size) == (3, True, 7) and not unresolved(mine)


def test_hf_engine_cuts_each_prompt_at_its_own_budget(tiny_model_dir):
    from trainer.engines import make_engine
    cfg = GRPOConfig(model=str(tiny_model_dir), gen_backend="hf", temperature=1.0, device="cpu")
    eng = make_engine(cfg, str(tiny_model_dir))
    assert eng.gen_batch_size == 64  # auto on CPU
    out = eng.generate([[1, 2, 3], [4, 5, 6]], 2, max_new_tokens=[2, 9])
    assert [len(s.completion_ids) <= b for s, b in zip(out, [2, 2, 9, 9])] == [True] * 4
    assert all(s.truncated for s in out[:2] if len(s.completion_ids) == 2 and s.completion_ids[-1] not in eng.eos_ids)
    with pytest.raises(ValueError, match="3 token budgets for 2 prompts"):
        eng.generate([[1, 2], [3, 4]], 1, max_new_tokens=[1, 2, 3])
