"""One resolver of the generation settings per device: the `auto` values of common/settings/generation_options.py
become numbers, the same way for launch.sh's placement (common/placement/launch_plan.py, --print-plan), the workers
(trainer/worker.py), the ranks (trainer/main.py) and the engines (trainer/engines/).

    cfg, lines = resolve_generation(cfg, cuda=True, producer="worker", ranks=4, workers=1, gpu_share=None)

On CUDA: CUDA graphs (vllm_eager false), a whole step's prompts per engine call (at least 256 sequences), 0.9 of a
GPU of its own. On CPU: what bench/generation_batching.py measured best there (eager, prefix caching on, a step's
prompts per call). Values the user set are kept as given. No torch here (the placement CLI imports it).
"""
from __future__ import annotations

import dataclasses
import math

from common.settings.generation_options import AUTO

ALONE_FRACTION = 0.9  # of a GPU of its own: vLLM's own default, room left for the CUDA context and graphs
MIN_GPU_SEQUENCES = 256  # sequences per call below which a GPU decode step is mostly idle (issue 42)
CPU_GEN_BATCH = 64  # HF rows per generate call on CPU (the former default)
SHOWN = ("vllm_eager", "vllm_enable_prefix_caching", "Q_batch_size", "vllm_gpu_memory_utilization")


def step_prompts(cfg, producer: str, ranks: int | None, workers: int | None) -> int:
    """Prompts one training step takes from this producer: a rank generating for itself makes its own step's
    (train_batch_groups x grad_accum); a worker its share of every rank's step."""
    per_rank = cfg.train_batch_groups * cfg.grad_accum
    if producer == "rank":
        return per_rank
    return max(1, math.ceil(per_rank * max(1, ranks or 1) / max(1, workers or cfg.num_gen_workers or 1)))


def auto_q_batch(cfg, *, cuda: bool, producer: str, ranks: int | None, workers: int | None) -> tuple[int, str]:
    """Q_batch_size auto, with the reason said in the log."""
    step = step_prompts(cfg, producer, ranks, workers)
    q, why = step, f"a step's prompts ({step})"
    if cuda and q * cfg.num_pre_Q < MIN_GPU_SEQUENCES:
        q, why = math.ceil(MIN_GPU_SEQUENCES / cfg.num_pre_Q), f"{MIN_GPU_SEQUENCES} sequences / num_pre_Q"
    if cfg.sync_steps > 0:  # a round is trained within max_staleness + 1 steps; more would be dropped as stale
        cap = step * (cfg.max_staleness + 1)
        if q > cap:
            q, why = cap, f"{why}, cut to the max_staleness + 1 = {cfg.max_staleness + 1} steps of {step} a round " \
                          f"is trained within (raise train_batch_groups for bigger calls)"
    return q, why


def resolve_generation(cfg, *, cuda: bool, producer: str = "worker", ranks: int | None = None,
                       workers: int | None = None, gpu_share: float | None = None):
    """cfg with every `auto` generation value resolved for this device, and one line per value for the log.
    producer: "worker" (a genonly worker) or "rank" (a trainer rank generating for itself); ranks/workers: how many
    there are (None: unknown, 1 rank, num_gen_workers workers); gpu_share: the placement's fraction of a shared GPU
    (None: the GPU is the worker's own)."""
    if producer not in ("worker", "rank"):
        raise ValueError(f"producer must be worker or rank (got {producer!r})")
    out, why = {}, {}
    if cfg.Q_batch_size == AUTO:
        out["Q_batch_size"], why["Q_batch_size"] = auto_q_batch(cfg, cuda=cuda, producer=producer, ranks=ranks,
                                                                workers=workers)
    q = out.get("Q_batch_size", cfg.Q_batch_size)
    if cfg.gen_batch_size == AUTO:
        out["gen_batch_size"] = q * cfg.num_pre_Q if cuda else CPU_GEN_BATCH
        why["gen_batch_size"] = "a whole round (cut to the GPU's free memory by the HF engine)" if cuda else "CPU"
    if cfg.vllm_eager == AUTO:
        out["vllm_eager"], why["vllm_eager"] = (False, "CUDA graphs") if cuda else (True, "CPU")
    if gpu_share is not None and cfg.vllm_gpu_memory_utilization == AUTO:
        out["vllm_gpu_memory_utilization"], why["vllm_gpu_memory_utilization"] = gpu_share, "share of a shared GPU"
    elif cfg.vllm_gpu_memory_utilization == AUTO:
        out["vllm_gpu_memory_utilization"] = ALONE_FRACTION
        why["vllm_gpu_memory_utilization"] = "a GPU of its own" if cuda else "unused on CPU"
    new = dataclasses.replace(cfg, **out) if out else cfg
    lines = [f"{k} {getattr(new, k)} ({why.get(k, 'as set')})" for k in (*SHOWN, "gen_batch_size")]
    return new, lines


def unresolved(cfg) -> list[str]:
    """Generation fields still `auto` (an engine refuses to start with any)."""
    return [k for k in ("Q_batch_size", "gen_batch_size", "vllm_eager", "vllm_gpu_memory_utilization")
            if getattr(cfg, k) == AUTO]


def on_cuda(device: str) -> bool:
    """Whether a process told `device` (auto, cpu, cuda, cuda:N) generates on a GPU (torch imported only here)."""
    if device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def resolve_at_start(cfg, log, who: str, *, producer: str, ranks: int | None = None):
    """A worker's or rank's first log lines: its precision (common/settings/precision.py) and generation settings
    resolved for the device it runs on."""
    from common.placement.gen_choice import resolve_machine
    cuda = on_cuda(cfg.device if producer == "worker" else "auto")
    cfg, said = resolve_machine(cfg, cuda=cuda)  # bf16, vllm_dtype, gen_backend auto: for this machine
    for line in said:
        log.info("%s", line)
    cfg, lines = resolve_generation(cfg, cuda=cuda, producer=producer, ranks=ranks)
    log.info("%s generation settings: %s", who, "; ".join(lines))
    return cfg
