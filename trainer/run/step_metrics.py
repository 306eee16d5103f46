"""What a training step logs: the trained batch's reward metrics, this rank's memory and model summary, and
their reduction over ranks (means, sums, maxima) into the one row rank 0 writes (trainer/run/metrics.py)."""
from __future__ import annotations

import logging

import torch

from common.wire.protocol import ScoredBatch
from trainer.dist import comm
from trainer.lora.adapters import is_lora, trainable_summary
from trainer.rewards.scoring import component_means
from trainer.tools.loop import tool_metrics

log = logging.getLogger("trainer")

# averaged over ranks / summed (counts; figures only rank 0 has) / maximum
MEAN_KEYS = ["loss", "reward_mean", "reward_std", "correct_rate", "format_rate", "kl", "clip_frac", "ratio_mean",
             "entropy", "completion_len", "tokens_per_s", "wait_s", "gen_s", "step_s", "staleness",
             "logp_mismatch_mean"]
SUM_KEYS = ["skipped_groups", "skipped_long_prompts", "rejected_batches", "dropped_stale", "lost_batches",
            "sync_s", "sync_mb", "sync_mb_up_delta", "sync_mb_up_full", "sync_mb_down_delta", "sync_mb_down_full",
            "reward_timeouts", "batches_from_workers", "batches_from_ranks"]
MAX_KEYS = ["staleness_max", "peak_mem_mb", "peak_reserved_mb", "logp_mismatch_max"]


def batch_metrics(b: ScoredBatch) -> dict:
    """Reward metrics of the batch trained on (its rollouts came from whichever producer)."""
    out = {}
    if b.rewards is not None:
        out["reward_mean"] = float(b.rewards.mean())
        out["reward_std"] = float(b.rewards.std()) if b.rewards.numel() > 1 else 0.0
    comps = b.extra.get("components", {})
    for name, key in (("correct", "correct_rate"), ("format", "format_rate")):
        vals = [v for v in comps.get(name, []) if v is not None]  # None: not applicable / timed out
        if vals:
            out[key] = sum(v > 0 for v in vals) / len(vals)
    out.update(component_means(comps))  # reward/<name>: each function's mean where it applied
    out["reward_timeouts"] = float(sum(b.extra.get("reward_timeouts", [])))
    out["completion_len"] = float(b.completion_lens.float().mean())
    if "tools" in b.extra:  # a tool run: tools/... per completion (trainer/tools/loop.py)
        out.update(tool_metrics(b.extra["tools"]))
    if "overlong_penalty" in b.extra:  # DAPO shaping: mean penalty added to the reward (not in reward_mean)
        out["overlong_penalty"] = sum(b.extra["overlong_penalty"]) / max(len(b.extra["overlong_penalty"]), 1)
    return out


def reduce_metrics(d: dict, mean: list[str], total: list[str], most: list[str]) -> dict:
    """Combine per-rank metrics: means, sums (counts, rank-0-only figures) and maxima."""
    vals = lambda keys: torch.tensor([float(d.get(k, 0.0)) for k in keys], dtype=torch.float64)  # noqa: E731
    m, t, x = vals(mean), vals(total), vals(most)
    comm.all_reduce(m)  # on the group's device (NCCL: CUDA), see trainer/dist/comm.py
    comm.all_reduce(t)
    comm.all_reduce(x, "max")
    m /= torch.distributed.get_world_size()
    return {**dict(zip(mean, m.tolist())), **dict(zip(total, t.tolist())), **dict(zip(most, x.tolist()))}


def model_summary(policy, rank: int) -> dict:
    """Trainable parameters and fraction (LoRA or full) and the size of the full weights, logged once."""
    summary = trainable_summary(policy)
    full_mb = sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in policy.parameters()) / 1e6
    if rank == 0:
        log.info("trainable parameters: %d of %d (%.4f%%)%s; full weights %.1f MB", summary["trainable_params"],
                 summary["total_params"], 100 * summary["trainable_fraction"],
                 " (LoRA adapters)" if is_lora(policy) else "", full_mb)
    # summed over ranks by reduce_metrics: only rank 0 contributes
    return {k: (float(v) if rank == 0 else 0.0) for k, v in {**summary, "full_weights_mb": full_mb}.items()}


def mem_keys(world: int) -> list[str]:
    return [f"peak_mem_mb_rank{r}" for r in range(world)]


def memory_row(rank: int, world: int) -> dict:
    """Peak memory of this rank (peak RSS on CPU, max allocated on GPU) under its own key, summed over ranks; on GPU
    also what the caching allocator reserved at most (peak_reserved_mb: what the GPU sees it hold, context aside)."""
    from trainer.lora.adapters import peak_memory_mb
    mb = peak_memory_mb()
    reserved = torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_available() else 0.0
    return {**{k: 0.0 for k in mem_keys(world)}, f"peak_mem_mb_rank{rank}": mb, "peak_mem_mb": mb,
            "peak_reserved_mb": reserved}


def reward_logged_metrics(batches: list[ScoredBatch], taken: dict) -> dict:
    """What reward functions logged with TRL's log_metric(name, value) for the trained batches: each name's mean
    over every value every rank's batches carry (an object collective: every rank calls it). Named as logged; a
    name one of our own metrics has (`taken`) keeps ours."""
    mine: dict[str, list[float]] = {}
    for b in batches:
        for name, values in (b.extra.get("reward_metrics") or {}).items():
            mine.setdefault(name, []).extend(float(v) for v in values)
    parts: list = [mine]
    if torch.distributed.is_initialized():
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, mine)
    merged: dict[str, list[float]] = {}
    for part in parts:
        for name, values in part.items():
            merged.setdefault(name, []).extend(values)
    return {name: sum(vs) / len(vs) for name, vs in merged.items() if vs and name not in taken}
