"""The launcher's memory estimate (common/placement/memory_plan.py) for a placement plan: each process's GPU
memory, a fit verdict per GPU, and, where the user left micro_batch_size / gradient_checkpointing unset, the values
the ranks get. common/placement/launch_plan.py prints it (launch.sh train, also with --print-plan) and hands the picked
values to the trainer's command line.

GPU memory comes from `nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits` (MiB per GPU, by
physical index); where that fails the estimate is printed without a verdict and nothing is picked here (the
ranks pick at start from their GPUs' free memory, trainer/memory_defaults.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from common.placement.memory_plan import (
    CUDA_CONTEXT,
    FIT_SHARE,
    GIB,
    RANK_CONTEXT,
    ModelShape,
    TrainSettings,
    describe_parts,
    gib,
    hf_worker_parts,
    pick,
    rank_parts,
    ref_parts,
    with_context,
)
from common.placement.plan import Plan

SMI_QUERY = ["--query-gpu=memory.total", "--format=csv,noheader,nounits"]


def gpu_memory() -> tuple[dict[int, int] | None, str]:
    """({physical GPU index: bytes}, how) or (None, why not)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, "no nvidia-smi on PATH"
    cmd = " ".join(["nvidia-smi", *SMI_QUERY])
    try:
        out = subprocess.run([smi, *SMI_QUERY], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`{cmd}` failed ({e})"
    if out.returncode != 0:
        return None, f"`{cmd}` failed (exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]})"
    try:
        mib = [int(float(line)) for line in out.stdout.split() if line.strip()]
    except ValueError:
        return None, f"`{cmd}` printed {out.stdout.strip()[:200]!r}, not MiB per GPU"
    return {i: m << 20 for i, m in enumerate(mib)}, cmd


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    trainer_args: list[str] = field(default_factory=list)  # the picked values, for the trainer's command line
    refusal: str | None = None  # set: the run cannot fit; launch.sh stops with it


def _dtype_bytes(name: str | None) -> int:
    return 4 if name in ("float32", "fp32") else 2  # auto is bf16 on CUDA (common/modeling.py pick_dtype)


def train_settings(cfg, ds: dict, shape: ModelShape, world: int, workers: int, micro: int,
                   gc: bool) -> TrainSettings:
    """The ranks' settings: GRPOConfig over ds_config (as trainer/deepspeed_policy.py's ds_config_for fills it)."""
    zero = ds.get("zero_optimization", {})
    stage = cfg.zero_stage if cfg.zero_stage is not None else int(zero.get("stage", 0))
    bf16 = cfg.bf16 in (True, "auto") if cfg.bf16 is not None else ds.get("bf16", {}).get("enabled") in (True, "auto")
    own_gen = workers == 0 or cfg.get_wait > 0  # the ranks generate when no scored batch is there in time
    return TrainSettings(
        world=world, stage=stage, bf16=bool(bf16), micro_rows=micro,
        lora_params=shape.lora_params(cfg.lora_r, list(cfg.lora_target_modules)) if cfg.lora_r > 0 else 0,
        seq_len=cfg.max_prompt_length + cfg.max_new_tokens, completion_len=cfg.max_new_tokens, checkpointing=gc,
        chunk_tokens=cfg.logp_chunk_tokens, bucket=int(zero.get("reduce_bucket_size", 500_000_000)),
        overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
        stage3_live=int(zero.get("stage3_max_live_parameters", 1_000_000_000)),
        stage3_prefetch=int(zero.get("stage3_prefetch_bucket_size", 50_000_000)),
        generate_rows=min(cfg.gen_batch_size, cfg.Q_batch_size * cfg.num_pre_Q) if own_gen else 0)


def reward_model_bytes(cfg, e: int) -> int:
    """The weights of the run's reward models (config.json: their shapes), 0 when none: embeddings, layers, final
    norm and the one-label score head (no LM head)."""
    shapes = [ModelShape.from_config(m["path"]) for m in cfg.reward_models()]
    return sum((s.vocab * s.hidden + s.layers * s.layer_params() + 2 * s.hidden) * e for s in shapes)


def _others(cfg, plan: Plan, shape: ModelShape, ref_shape: ModelShape, mem: dict[int, int] | None,
            ref_dtype: str) -> tuple[dict[int, list[tuple[str, int, str]]], list[str]]:
    """({GPU: [(process, bytes, how)]} of the ref server and the workers, the vLLM workers that cannot start)."""
    seq = cfg.max_prompt_length + cfg.max_new_tokens
    others: dict[int, list[tuple[str, int, str]]] = {}  # GPU -> (process, bytes, how) of every non-rank process
    short: list[str] = []  # vLLM workers whose weights do not fit in their fraction
    if plan.ref and plan.ref.gpus:
        e = _dtype_bytes(ref_dtype)
        parts = with_context(ref_parts(ref_shape, e, cfg.num_pre_Q, seq, cfg.max_new_tokens, cfg.logp_chunk_tokens),
                             True)
        rm = reward_model_bytes(cfg, e)
        if rm:  # held beside the reference model, same dtype (ref_server/reward_models.py)
            parts["reward_models"] = rm
        others.setdefault(plan.ref.gpus[0], []).append(("ref_server", sum(parts.values()), describe_parts(parts)))
    for w in plan.workers:
        g = w.gpus[0]
        if cfg.gen_backend == "vllm":
            frac = dict(w.gen).get("vllm_gpu_memory_utilization") or w.vllm_gpu_memory_utilization or \
                cfg.vllm_gpu_memory_utilization
            weights = shape.params() * _dtype_bytes(cfg.vllm_dtype)
            total = mem[g] if mem and g in mem else None
            said = (f"vLLM reserves {frac:g} x the GPU" + (f" = {gib(frac * total)} GiB (weights {gib(weights)}, "
                    f"{gib(frac * total - weights - CUDA_CONTEXT)} left for its KV cache)" if total else
                    f" (weights {gib(weights)} GiB)"))
            need = int(frac * total) if total else weights + CUDA_CONTEXT
            if total and frac * total - weights - CUDA_CONTEXT <= 0:
                said += ": its weights do not fit in its fraction, it would NOT start"
                short.append(w.name)
            others.setdefault(g, []).append((w.name, need, said))
        else:
            q = dict(w.gen).get("Q_batch_size", cfg.Q_batch_size)  # the worker's own round (its HF engine caps it)
            parts = with_context(hf_worker_parts(shape, _dtype_bytes(cfg.worker_dtype),
                                                 min(cfg.gen_batch_size, q * cfg.num_pre_Q), seq,
                                                 cfg.num_pre_Q if cfg.compute_gen_logps else 0, cfg.max_new_tokens,
                                                 cfg.logp_chunk_tokens), True)
            others.setdefault(g, []).append((w.name, sum(parts.values()), describe_parts(parts)))
    return others, short


def memory_report(cfg, plan: Plan, ref_model: str | None = None, ref_dtype: str = "auto") -> Report:
    """The estimate and verdict for `plan` (a GPU plan) and the GRPOConfig `cfg`."""
    from common.settings.gen_defaults import resolve_generation, unresolved
    if unresolved(cfg):  # as the ranks resolve theirs on a GPU (launch.sh passes a resolved cfg)
        cfg, _ = resolve_generation(cfg, cuda=True, producer="rank", ranks=plan.num_ranks)
    rep = Report()
    try:
        shape = ModelShape.from_config(cfg.model)
        ref_shape = shape if (ref_model or cfg.model) == cfg.model else ModelShape.from_config(ref_model)
        ds = json.loads(Path(cfg.ds_config).read_text())
    except (OSError, ValueError, AttributeError) as e:
        rep.lines.append(f"memory estimate: cannot read the model's config.json or ds_config ({type(e).__name__}: "
                         f"{e}); no estimate, the ranks pick micro_batch_size/gradient_checkpointing at start")
        return rep
    mem, how = gpu_memory()
    rows = cfg.train_batch_groups * cfg.num_pre_Q
    seq = cfg.max_prompt_length + cfg.max_new_tokens
    others, short = _others(cfg, plan, shape, ref_shape, mem, ref_dtype)

    def rank_need(micro: int, gc: bool) -> dict[str, int]:
        s = train_settings(cfg, ds, shape, plan.num_ranks, len(plan.workers), micro, gc)
        return with_context(rank_parts(shape, s), True, RANK_CONTEXT)

    def room(g: int) -> int:  # what the ranks may use on GPU g
        return int(FIT_SHARE * mem[g]) - sum(b for _, b, _ in others.get(g, []))

    rank_gpus = plan.ranks.gpus
    known = mem is not None and all(g in mem for g in plan.gpus)
    fits = lambda m, gc: known and all(sum(rank_need(m, gc).values()) <= room(g) for g in rank_gpus)  # noqa: E731
    micro, gc = cfg.micro_batch_size, cfg.gradient_checkpointing
    unset = [k for k, v in (("micro_batch_size", micro), ("gradient_checkpointing", gc)) if v is None]
    chosen = pick(fits, rows, micro, gc) if (known and unset) else None
    if chosen:
        micro, gc = chosen
        rep.trainer_args = [a for k, v in (("micro_batch_size", micro), ("gradient_checkpointing", gc))
                            if k in unset for a in (f"--{k}", str(v).lower())]
    m_show, gc_show = min(micro or rows, rows), bool(gc)
    parts = rank_need(m_show, gc_show)
    s = train_settings(cfg, ds, shape, plan.num_ranks, len(plan.workers), m_show, gc_show)
    lora = s.lora_params
    rep.lines.append(
        f"memory estimate ({cfg.model}: {shape.params() / 1e9:.2f} B parameters" +
        (f", LoRA {lora / 1e6:.1f} M trained" if lora else "") +
        f"; ZeRO-{s.stage} over {plan.num_ranks} rank(s), {'bf16' if s.bf16 else 'fp32'}, micro-batch {m_show} of "
        f"{rows} rows x {seq} tokens, gradient checkpointing {'on' if gc_show else 'off'}; docs/gpus.md):")
    verdict = lambda name, need, g: "" if not known or name in short else (  # noqa: E731
        f"; GPU {g}: {gib(mem[g])} GiB: " + ("fits" if need <= FIT_SHARE * mem[g] else "would NOT fit"))
    for g in sorted(set(rank_gpus) | set(others)):
        here = others.get(g, []) + ([("ranks", sum(parts.values()), describe_parts(parts) + " (each rank)")]
                                    if g in rank_gpus else [])
        for name, need, said in here:
            if g in rank_gpus and name == "ranks" and g != rank_gpus[0] and not others.get(g):
                continue  # the same line for every rank GPU alone: shown once, for the first
            rep.lines.append(f"  {name:<11}{said}" + (verdict(name, need, g) if len(here) == 1 else ""))
        if len(here) > 1 and known:
            total = sum(b for _, b, _ in here)
            rep.lines.append(f"  GPU {g} shared: {' + '.join(gib(b) for _, b, _ in here)} = {gib(total)} GiB of "
                             f"{gib(mem[g])}: " + ("fits" if total <= FIT_SHARE * mem[g] else "would NOT fit"))
    if len(rank_gpus) > 1 and not any(others.get(g) for g in rank_gpus[1:]):
        rep.lines.append(f"  (ranks on GPUs {list(rank_gpus)}: the same on each)")
    if not known:
        rep.lines.append(f"  no fit verdict: GPU memory unknown ({how})" +
                         ("; the ranks pick " + " and ".join(unset) + " at start" if unset else ""))
        return rep
    if chosen:
        rep.lines.append("  picked (left unset): " + ", ".join(f"{k} {v}" for k, v in zip(
            ("micro_batch_size", "gradient_checkpointing"), (micro, str(gc).lower())) if k in unset) +
            " (the largest micro-batch that fits, checkpointing only where none fits without it)")
    elif unset:
        least = rank_need(1, True)
        worst = min(rank_gpus, key=room)
        rep.refusal = (f"the ranks need {gib(sum(least.values()))} GiB each even at micro_batch_size 1 with "
                       f"gradient checkpointing ({describe_parts(least)}), GPU {worst} leaves them "
                       f"{gib(room(worst))} GiB ({FIT_SHARE:g} x {gib(mem[worst])} less what shares it): use more "
                       f"ranks, zero_stage 3, LoRA (lora_r), a shorter max_prompt_length/max_new_tokens or larger GPUs")
    elif not fits(m_show, gc_show):
        rep.lines.append("  WARNING: by this estimate the ranks would not fit with the micro_batch_size and "
                         "gradient_checkpointing you set; starting as asked")
    return rep


__all__ = ["GIB", "Report", "gpu_memory", "memory_report", "train_settings"]
