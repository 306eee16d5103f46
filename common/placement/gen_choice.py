"""gen_backend auto: which generation engine a run's workers use, from what each costs at the model's shape on this
kind of machine (issue 62). An explicit hf or vllm is kept as it is.

    backend, why = choose_gen_backend(cfg, cuda=False)   # ("hf", "avx2 CPU, nearest measured shape ...")

On a CPU the choice comes from COSTS: per CPU class (native bf16 or not: common/settings/precision.py) and per
measured shape (parameters, completion length), the CPU-seconds each engine cost there (docs/benchmarks.md, "gen_
backend auto"). A run takes the entry nearest its own shape (parameters on a log scale, then max_new_tokens) and
the cheaper engine of it. On CUDA auto is hf: the engine bench/gpu_check.py ran on a GPU (vLLM there: say so with
gen_backend vllm). Without vLLM installed auto is hf. No torch imported (launch.sh's placement runs this).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math

from common.settings.precision import native_bf16, resolve_precision

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Cost:
    """One measured shape: CPU-seconds per unit of work of each engine (the same unit for both)."""
    shape: str
    params: float
    new_tokens: int
    hf: float
    vllm: float
    unit: str


# tiny: measured on a 2-core AMD EPYC (Zen 5, AVX-512 BF16), 2026-12-04 at 409cbad (docs/benchmarks.md, "gen_backend
# auto"): "avx512_bf16" natively (bf16 ranks, the vLLM worker and the HF worker in bf16: what auto resolves to
# there), "avx2" with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (float32). The demo's whole run (every
# process) per training step (6 groups of 8 with spread), steady state: (90-step run - 30-step run) / 60
# (bench/vs_trl.py --only ours), the mean of two pairs. Natively the HF worker in float32 (worker_dtype auto's
# choice until then) cost 0.63. The AVX2-only EPYC agreed: HF 347.0 vs vLLM 404.8 CPU-s over 150 steps.
# qwen05b (2026-12-02 at 8c4360c): the engine's CPU-s per 1,000 generated tokens, 1 thread, 16 sequences a call
# (bench/generation.py --models qwen05b --prompts 2 --hf-dtype float32), random weights in Qwen2.5-0.5B's shape;
# HF's figure leaves out the logprob forward it also needs, and is float32 on both classes. HF in bf16 (what
# worker_dtype auto now gives natively), 32 new tokens, 2026-12-04: 11.6 against float32's 23.2 and vLLM's 7.6
# the same day: vLLM stays the cheaper at this shape.
TINY = dict(shape="tiny (the demo, 32 new tokens)", params=1.15e6, new_tokens=32,
            unit="CPU-s per training step, all processes")
Q05_SHORT = dict(shape="Qwen2.5-0.5B, 32 new tokens", params=4.94e8, new_tokens=32,
                 unit="CPU-s per 1,000 generated tokens")
Q05_LONG = dict(Q05_SHORT, shape="Qwen2.5-0.5B, 256 new tokens", new_tokens=256)
COSTS: dict[str, tuple[Cost, ...]] = {
    "avx512_bf16": (Cost(**TINY, hf=0.46, vllm=0.60), Cost(**Q05_SHORT, hf=33.4, vllm=8.6),
                    Cost(**Q05_LONG, hf=27.7, vllm=7.8)),
    "avx2": (Cost(**TINY, hf=0.55, vllm=0.65), Cost(**Q05_SHORT, hf=32.3, vllm=19.9),
             Cost(**Q05_LONG, hf=26.1, vllm=15.6)),
}


def cpu_class(env=None, flags: set[str] | None = None) -> str:
    """The COSTS row this CPU reads: avx512_bf16 where torch runs bf16 natively, else avx2."""
    return "avx512_bf16" if native_bf16(env, flags)[0] else "avx2"


def model_params(model: str) -> tuple[float | None, str]:
    """(the policy's parameter count from its config.json, no weights read; or None and why it cannot be read)."""
    from common.placement.memory_plan import ModelShape
    try:
        return float(ModelShape.from_config(model).params()), ""
    except (OSError, ValueError, KeyError) as e:  # a hub id not in the cache, an unknown architecture
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def nearest(costs: tuple[Cost, ...], params: float, new_tokens: int) -> Cost:
    """The measured entry closest to this run: parameters on a log scale first, then completion length."""
    return min(costs, key=lambda c: (round(abs(math.log10(c.params / params)), 1),
                                     abs(math.log2(c.new_tokens / max(1, new_tokens)))))


def choose_gen_backend(cfg, *, cuda: bool, env=None, flags: set[str] | None = None,
                       params: float | None = None) -> tuple[str, str]:
    """(hf or vllm, why): cfg.gen_backend when it is not auto, else the rule above."""
    if cfg.gen_backend != AUTO:
        return cfg.gen_backend, "as set"
    if cuda:
        return "hf", "on CUDA: HF, the engine the GPU check ran (gen_backend vllm for vLLM)"
    if importlib.util.find_spec("vllm") is None:
        return "hf", "vLLM is not installed"
    cls = cpu_class(env, flags)
    params, unknown = model_params(cfg.model) if params is None else (params, "")
    if params is None:
        return "hf", f"the model's shape is unknown ({unknown}): hf, the default"
    c = nearest(COSTS[cls], params, cfg.max_new_tokens)
    pick = "hf" if c.hf <= c.vllm else "vllm"
    return pick, (f"{cls} CPU, nearest measured shape {c.shape}: hf {c.hf:g} vs vllm {c.vllm:g} {c.unit} "
                  f"(docs/benchmarks.md)")


def resolve_gen_backend(cfg, *, cuda: bool, **kw):
    """(cfg with gen_backend resolved, the log line saying the choice)."""
    backend, why = choose_gen_backend(cfg, cuda=cuda, **kw)
    given = cfg.gen_backend
    return dataclasses.replace(cfg, gen_backend=backend), f"gen_backend {given}: {backend} ({why})"


def resolve_machine(cfg, *, cuda: bool, probe_gpu: bool = True):
    """(cfg with bf16, vllm_dtype and gen_backend auto resolved for this machine, the lines saying how): what
    launch.sh's plan prints (probe_gpu False: no torch there) and every rank and worker logs at its start."""
    cfg, precision = resolve_precision(cfg, cuda=cuda, probe_gpu=probe_gpu)
    if cfg.gen_backend != AUTO:
        return cfg, [precision]
    cfg, backend = resolve_gen_backend(cfg, cuda=cuda)
    return cfg, [precision, backend]


def backend_words(cfg) -> str:
    """`hf`, or `vllm (gen_backend auto)`: what launch.sh check says the workers generate with on this machine."""
    if cfg.gen_backend != AUTO:
        return cfg.gen_backend
    import torch  # (launch.sh check has it loaded; common/settings/gen_defaults.py's on_cuda would be a circle)
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    return f"{choose_gen_backend(cfg, cuda=cuda)[0]} (gen_backend auto)"
