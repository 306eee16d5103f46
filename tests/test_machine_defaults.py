"""bf16, vllm_dtype and gen_backend `auto`, resolved for the machine a run is on (issue 62): what the CPU does
natively (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA caps count as none), the one log line saying it, explicit
settings kept, and `launch.sh train --print-plan` showing the choice."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from common.config import GRPOConfig
from common.placement.gen_choice import COSTS, choose_gen_backend, cpu_class, resolve_machine
from common.settings.knobs import load_config
from common.settings.precision import cpu_flags, native_bf16, resolve_precision

ZEN5 = {"avx2", "avx512f", "avx512_bf16"}  # this kind of CPU's flags (the parts that matter)
DEMO = ["--config", str(REPO / "configs" / "demo.json")]


@pytest.mark.parametrize("env, flags, want", [
    ({}, ZEN5, True),
    ({}, {"avx2", "amx_bf16", "amx_tile"}, True),
    ({}, {"avx2", "fma"}, False),  # the AVX2 EPYC
    ({"ATEN_CPU_CAPABILITY": "avx2"}, ZEN5, False),
    ({"ATEN_CPU_CAPABILITY": "default"}, ZEN5, False),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, ZEN5, True),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, ZEN5, False),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, ZEN5, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ZEN5, True),
])
def test_native_bf16_follows_the_cpu_and_its_caps(env, flags, want):
    assert native_bf16(env, flags)[0] is want


def test_bf16_auto_resolves_per_cpu_with_the_fixed_log_line():
    cfg = load_config(GRPOConfig, DEMO)
    assert (cfg.bf16, cfg.vllm_dtype, cfg.gen_backend) == ("auto", "auto", "auto")  # configs/demo.json says auto
    out, line = resolve_precision(cfg, cuda=False, env={}, flags={"avx2"})
    assert (out.bf16, out.vllm_dtype) == (False, "float32")
    assert line.startswith("precision: float32 (bf16 auto: no native bf16 on this CPU)"), line
    out, line = resolve_precision(cfg, cuda=False, env={"ATEN_CPU_CAPABILITY": "avx2"}, flags=ZEN5)
    assert (out.bf16, out.vllm_dtype) == (False, "float32") and "ATEN_CPU_CAPABILITY=avx2" in line, line
    out, line = resolve_precision(cfg, cuda=False, env={}, flags=ZEN5)
    assert (out.bf16, out.vllm_dtype) == (True, "bfloat16") and line.startswith("precision: bfloat16 (bf16 auto: "
                                                                                 "AVX-512 BF16 on this CPU)"), line


def test_worker_dtype_auto_follows_the_ranks_on_cpu():
    """The HF worker in bf16 where the ranks are (natively: the demo's run 0.73x the CPU-s of a float32 one), float32
    elsewhere; an explicit worker_dtype and CUDA's auto are kept."""
    cfg = load_config(GRPOConfig, DEMO)
    out, line = resolve_precision(cfg, cuda=False, env={}, flags=ZEN5)
    assert out.worker_dtype == "bfloat16" and line.endswith("; worker_dtype auto: bfloat16"), line
    out, line = resolve_precision(cfg, cuda=False, env={"ATEN_CPU_CAPABILITY": "avx2"}, flags=ZEN5)
    assert out.worker_dtype == "auto" and line.endswith("; worker_dtype auto: float32"), line
    explicit = load_config(GRPOConfig, [*DEMO, "--worker_dtype", "float32"])
    assert resolve_precision(explicit, cuda=False, env={}, flags=ZEN5)[0].worker_dtype == "float32"
    assert resolve_precision(GRPOConfig(bf16=True), cuda=True)[0].worker_dtype == "auto"


def test_explicit_precision_wins_and_null_keeps_ds_config(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    cfg = load_config(GRPOConfig, [*DEMO, "--bf16", "true", "--vllm_dtype", "float16"])
    out, line = resolve_precision(cfg, cuda=False)
    assert (out.bf16, out.vllm_dtype) == (True, "float16") and line.startswith("precision: bfloat16 (bf16 true: "
                                                                                "as set)"), line
    out, _ = resolve_precision(load_config(GRPOConfig, ["--bf16", "false"]), cuda=False)
    assert (out.bf16, out.vllm_dtype) == (False, "float32")  # vllm_dtype auto follows the ranks on CPU
    out, line = resolve_precision(GRPOConfig(), cuda=False)  # the default: ds_config's bf16.enabled decides
    assert out.bf16 is None and "ds_config" in line
    assert resolve_precision(GRPOConfig(vllm_dtype="auto"), cuda=True)[0].vllm_dtype == "auto"  # CUDA: vLLM's auto


def test_this_machine_reads_its_own_flags(monkeypatch):
    """The real /proc/cpuinfo of the machine the suite runs on, the emulation of an AVX2 CPU on top of it."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert native_bf16()[0] is native
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert native_bf16()[0] is False and cpu_class() == "avx2"


def test_gen_backend_auto_takes_the_cheaper_measured_engine_and_explicit_wins():
    cfg = load_config(GRPOConfig, DEMO)
    for cls, rows in COSTS.items():
        assert rows, f"no measured shape for {cls}"
        flags = ZEN5 if cls == "avx512_bf16" else {"avx2"}
        for c in rows:
            got, why = choose_gen_backend(GRPOConfig(gen_backend="auto", max_new_tokens=c.new_tokens), cuda=False,
                                          env={}, flags=flags, params=c.params)
            assert got == ("hf" if c.hf <= c.vllm else "vllm") and c.shape in why, (cls, c, why)
    assert choose_gen_backend(cfg, cuda=True)[0] == "hf"
    for given in ("hf", "vllm"):
        out, lines = resolve_machine(load_config(GRPOConfig, [*DEMO, "--gen_backend", given]), cuda=False)
        assert out.gen_backend == given and len(lines) == 1  # as set: no choice to say


def print_plan(tmp_path, env: dict, *trainer_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch.sh"), "train", "--print-plan", "--", *DEMO, *trainer_args],
                          cwd=tmp_path, env=subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO), **env),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_print_plan_shows_the_machine_choices(tmp_path):
    """configs/demo.json on an AVX2 CPU (emulated): float32 said, the worker started with the engine chosen."""
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = print_plan(tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: precision: float32 (bf16 auto: no native bf16 on this CPU" in r.stderr, r.stderr
    want, _ = choose_gen_backend(load_config(GRPOConfig, DEMO), cuda=False, env=env)
    assert f"note: gen_backend auto: {want} (avx2 CPU" in r.stderr, r.stderr
    assert f"worker0: (environment unchanged) --gen_backend {want} " in r.stdout, r.stdout
    r = print_plan(tmp_path, env, "--gen_backend", "vllm", "--bf16", "true")  # explicit settings win
    assert r.returncode == 0 and "--gen_backend" not in r.stdout and "gen_backend auto" not in r.stderr, r.stderr
    assert "note: precision: bfloat16 (bf16 true: as set)" in r.stderr, r.stderr


def test_the_tool_demo_trains_in_float32_without_native_bf16():
    """configs/demo_tools.json too (launch.sh demo --tools switched it itself before): bf16 and vllm_dtype auto."""
    cfg = load_config(GRPOConfig, ["--config", str(REPO / "configs" / "demo_tools.json")])
    out, line = resolve_precision(cfg, cuda=False, env={"ATEN_CPU_CAPABILITY": "avx2"}, flags=ZEN5)
    assert (out.bf16, out.vllm_dtype, out.gen_backend) == (False, "float32", "vllm"), line
    out, _ = resolve_precision(cfg, cuda=False, env={}, flags=ZEN5)
    assert (out.bf16, out.vllm_dtype) == (True, "bfloat16")


def test_the_plan_leaves_bf16_auto_on_gpus_to_the_ranks():
    """launch.sh's plan imports no torch: on a GPU node bf16 auto stays auto there, each rank resolves it."""
    cfg = load_config(GRPOConfig, DEMO)
    out, lines = resolve_machine(cfg, cuda=True, probe_gpu=False)
    assert (out.bf16, out.vllm_dtype, out.gen_backend) == ("auto", "auto", "hf") and "each rank" in lines[0], lines


def test_launch_check_names_the_engine_auto_chose():
    from common.placement.gen_choice import backend_words
    cfg = load_config(GRPOConfig, DEMO)
    assert backend_words(cfg) == f"{choose_gen_backend(cfg, cuda=False)[0]} (gen_backend auto)"
    assert backend_words(load_config(GRPOConfig, [*DEMO, "--gen_backend", "hf"])) == "hf"


def test_cpu_ranks_auto_follows_the_measured_table(monkeypatch):
    """One CPU rank where it was measured cheaper (2 cores, the demo's shape, both CPU classes), taking two ranks'
    groups; the former 2 ranks elsewhere (more cores, an unmeasured shape, a table where two were cheaper)."""
    import common.placement.cpu_ranks as cr
    cfg = load_config(GRPOConfig, [*DEMO, "--grad_accum", "2"])
    for env in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        ranks, args, why = cr.auto_cpu_ranks(cfg, cores=2, env=env, flags=ZEN5)
        c = cr.RANK_COSTS[cpu_class(env, ZEN5)][0]
        assert c.one_cpu_s < c.two_cpu_s and c.one_wall_s < c.two_wall_s  # why the table says 1
        g = cfg.train_batch_groups  # configs/demo.json's, written for two ranks: one rank takes 2 x g
        assert (ranks, args) == (1, ["--train_batch_groups", str(2 * g)]), why
        assert f"{cpu_class(env, ZEN5)} CPU" in why and f"a step is still {4 * g} groups" in why, why
    assert cr.auto_cpu_ranks(cfg, cores=16, flags=ZEN5)[:2] == (2, [])
    ranks, args, why = cr.auto_cpu_ranks(cfg, cores=2, flags=ZEN5, params=4.94e8)  # Qwen2.5-0.5B: not measured
    assert (ranks, args) == (2, []) and "not measured" in why, why
    monkeypatch.setattr(cr, "RANK_COSTS", {"avx512_bf16": (cr.RankCost("tiny", 1.15e6, 70.0, 80.0, 50.0, 60.0),)})
    assert cr.auto_cpu_ranks(cfg, cores=2, flags=ZEN5)[:2] == (2, [])


def test_print_plan_shows_the_cpu_rank_choice_and_gpus_wins(tmp_path):
    """launch.sh train on CPU without --gpus: the plan's one line, one rank, every process told the step's groups;
    --gpus 2: two ranks of the config's groups, nothing rescaled. One core (taskset), so the host is measured."""
    def plan(*launch_args):
        return subprocess.run(["taskset", "-c", "0", "bash", str(REPO / "launch.sh"), "train", *launch_args,
                               "--print-plan", "--", *DEMO], cwd=tmp_path, capture_output=True, text=True,
                              env=subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO)), timeout=120,
                              stdin=subprocess.DEVNULL)
    g = load_config(GRPOConfig, DEMO).train_batch_groups  # configs/demo.json's, for two ranks
    r = plan()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: ranks auto: 1 (" in r.stderr and f"train_batch_groups {g} -> {2 * g}" in r.stderr, r.stderr
    assert "1 rank(s), deepspeed --num_gpus 1" in r.stderr, r.stderr
    assert f"trainer: deepspeed --num_gpus 1 --train_batch_groups {2 * g}" in r.stdout, r.stdout
    r = plan("--gpus", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ranks auto" not in r.stderr and "trainer: deepspeed --num_gpus 2\n" in r.stdout, r.stdout + r.stderr
