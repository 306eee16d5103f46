"""What a training step logs: the trained batch's reward metrics, this rank's memory and model summary, and
their reduction over ranks (means, sums, maxima) into the one row rank 0 writes (trainer/run/metrics.py)."""
from __future__ import annotations

import logging

import torch

from common.wire.protocol import ScoredBatch
from trainer.dist import comm
from trainer.lora.adapters import is_lora, trainable_summary
from trainer.tools.multi_turn import tool_metrics

log = logging.getLogger("trainer")

# averaged over ranks / summed (counts; figures only rank 0 has) / maximum
MEAN_KEYS = ["loss", "reward_mean", "reward_std", "correct_rate", "format_rate", "kl", "clip_frac", "ratio_mean",
             "entropy", "completion_len", "tokens_per_s", "wait_s", "gen_s", "step_s", "staleness",
             "logp_mismatch_mean"]
SUM_KEYS = ["skipped_groups", "skipped_long_prompts", "rejected_batches", "dropped_stale", "lost_batches",
            "sync_s", "sync_mb", "sync_mb_up_delta", "sync_mb_up_full", "sync_mb_down_delta", "sync_mb_down_full",
            "reward_timeouts", "batches_from_workers", "batches_from_ranks"]
MAX_KEYS = ["staleness_max", "peak_mem_mb", "peak_reserved_mb", "logp_mismatch_max"]


def scored_rewards(b: ScoredBatch) -> list[float]:
    """The batch's rewards of the completions some reward scored: an unscorable one (every component None; NaN in
    TRL, 0 on the wire) is left out, as TRL's nanmean leaves it out."""
    if b.rewards is None:
        return []
    comps = list(b.extra.get("components", {}).values())
    return [float(r) for k, r in enumerate(b.rewards.tolist())
            if not comps or any(vals[k] is not None for vals in comps)]


def reward_stats(values: list[float]) -> dict:
    """reward_mean / reward_std as TRL logs them (nanmean, nanstd with Bessel's correction); none of either
    when no completion was scored (TRL: NaN), never 0."""
    if not values:
        return {}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {"reward_mean": mean, "reward_std": var ** 0.5}


def batch_metrics(b: ScoredBatch) -> dict:
    """Reward metrics of the batch trained on (its rollouts came from whichever producer)."""
    out = reward_stats(scored_rewards(b))
    comps = b.extra.get("components", {})
    for name, key in (("correct", "correct_rate"), ("format", "format_rate")):
        vals = [v for v in comps.get(name, []) if v is not None]  # None: not applicable / timed out
        if vals:
            out[key] = sum(v > 0 for v in vals) / len(vals)
    out.update(component_means(comps))  # reward/<name>: each function's mean where it applied
    out["reward_timeouts"] = float(sum(b.extra.get("reward_timeouts", [])))
    out["completion_len"] = float(b.completion_lens.float().mean())
    if "tools" in b.extra:  # a tool run: tools/... per completion (trainer/tools/multi_turn.py)
        out.update(tool_metrics(b.extra["tools"]))
    if "agent" in b.extra:  # an agent run: calls and training rows (segments) per rollout of the trained groups
        n = max(sum(b.extra["agent"]["rollouts"]), 1)
        out["agent/calls_per_rollout"] = sum(b.extra["agent"]["calls"]) / n
        out["agent/segments_per_rollout"] = sum(b.extra["agent"]["segments"]) / n
    if "overlong_penalty" in b.extra:  # DAPO shaping: mean penalty added to the reward (not in reward_mean)
        out["overlong_penalty"] = sum(b.extra["overlong_penalty"]) / max(len(b.extra["overlong_penalty"]), 1)
    return out


def nan_aware(key: str) -> bool:
    """A reward metric that may have no value (TRL: NaN, left out of nanmean): reward_mean, reward_std and
    reward/<name> (a function None on every completion it saw)."""
    return key.startswith("reward")


def reduce_metrics(d: dict, mean: list[str], total: list[str], most: list[str]) -> dict:
    """Combine per-rank metrics: means, sums (counts, rank-0-only figures) and maxima. A reward metric (nan_aware)
    is averaged over the ranks that have it and left out of the row when none has it (logged absent, not 0)."""
    vals = lambda keys: torch.tensor([float(d.get(k, 0.0)) for k in keys], dtype=torch.float64)  # noqa: E731
    have = torch.tensor([float(k in d) for k in mean], dtype=torch.float64)
    m, t, x = torch.cat([vals(mean), have]), vals(total), vals(most)
    comm.all_reduce(m)  # on the group's device (NCCL: CUDA), see trainer/dist/comm.py
    comm.all_reduce(t)
    comm.all_reduce(x, "max")
    m, have = m[:len(mean)], m[len(mean):]
    world = torch.distributed.get_world_size()
    means = {k: v / (n if nan_aware(k) else world) for k, v, n in zip(mean, m.tolist(), have.tolist())
             if n > 0 or not nan_aware(k)}
    return {**means, **dict(zip(total, t.tolist())), **dict(zip(most, x.tolist()))}


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
    """What reward functions logged with TRL's log_metric(name, value) in the generation rounds the step's batches
    came from (every rank's; a round counted once, however many of its batches there are; a round that trained
    nothing is in the next one's): each name's mean over those values (an object collective: every rank calls it).
    Named as logged; a name one of our own metrics has (`taken`) keeps ours."""
    mine: dict[str, dict] = {}
    for b in batches:
        for entry in b.extra.get("round_metrics") or []:
            mine[entry["round"]] = entry["metrics"]
    parts: list = [mine]
    if torch.distributed.is_initialized():
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, mine)
    rounds = {rid: m for part in parts for rid, m in part.items()}
    merged: dict[str, list[float]] = {}
    for m in rounds.values():
        for name, values in m.items():
            merged.setdefault(name, []).extend(float(v) for v in values)
    return {name: sum(vs) / len(vs) for name, vs in merged.items() if vs and name not in taken}


def component_means(components: dict[str, list]) -> dict[str, float]:
    """Per-function mean over the completions where it applied ("reward/<name>" metrics)."""
    out = {}
    for name, vals in components.items():
        vs = [v for v in vals if v is not None]
        if vs:
            out[f"reward/{name}"] = sum(vs) / len(vs)
    return out
