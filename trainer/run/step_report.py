"""What a training step reports, apart from the step itself (trainer/loop.py): the rollout counters of the batches
it fetched, its metrics row (reduced over the ranks, logged by rank 0), completions.jsonl, the progress bar, the
cumulative totals the heartbeat shows, and the stop agreement that rides on the ranks' exchange of what they trained.

Every rank calls `row` and `reduce` at every step, in this order: they hold the step's collectives (the exchange of
trained examples and stop requests, completions.jsonl's gather, the metrics reduction).
"""
from __future__ import annotations

import math
import time

import torch

from trainer.batches import RANK_PRODUCER
from trainer.run.completions import completion_rows, gather_rows
from trainer.run.requeue import agreed
from trainer.run.rollout_stats import RolloutStats
from trainer.run.step_metrics import (
    MAX_KEYS,
    MEAN_KEYS,
    SUM_KEYS,
    batch_metrics,
    mem_keys,
    memory_row,
    reduce_metrics,
    reward_logged_metrics,
    reward_stats,
    scored_rewards,
)
from trainer.tools.multi_turn import add_tool_totals, tool_metric_keys


def round_info(infos: list[dict]) -> dict:
    """BatchSource's counters summed over the batches fetched this step (none on a round's later passes)."""
    out = {"wait_s": 0.0, "gen_s": 0.0, "rejected_batches": 0, "dropped_stale": 0, "lost_batches": 0}
    own = RolloutStats()
    for info in infos:
        for k in out:
            out[k] += info[k]
        own.merge(info["own_gen"])  # its tool statistics too (they reach the /status totals)
    return {**out, "own_gen": own}


def round_metrics(batches: list) -> dict:
    """Reward metrics of the batches this step trained on, averaged over them; reward_mean / reward_std over their
    scored completions together (TRL's nanmean / nanstd over the batch)."""
    rows = [batch_metrics(b) for b in batches]
    keys = set().union(*rows) - {"reward_mean", "reward_std"}
    out = {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}
    return {**out, **reward_stats([v for b in batches for v in scored_rewards(b)])}


class StepReport:
    """One per rank. `totals` (skipped groups, dropped stale batches, tool calls) is what the heartbeat shows."""

    def __init__(self, cfg, rank: int, world: int, start_step: int, setup_row: dict, scorer_names: list[str],
                 objective_keys: tuple[list, list], totals: dict, metrics, completions, tok, stop, toolbox):
        from tqdm import tqdm

        self.cfg, self.rank, self.world, self.start_step, self.setup_row = cfg, rank, world, start_step, setup_row
        self.totals, self.metrics, self.completions, self.tok, self.stop = totals, metrics, completions, tok, stop
        self.has_tools = toolbox is not None
        objective_mean, self.objective_sum = objective_keys  # IS weights, masked shares, GSPO band, round pass
        self.keys = MEAN_KEYS + [f"reward/{name}" for name in scorer_names]
        self.keys += ["overlong_penalty"] if cfg.overlong_buffer > 0 else []
        self.keys += tool_metric_keys(toolbox.names) if toolbox is not None else []  # tools/... per completion
        self.keys += objective_mean
        self.agent = bool(cfg.agent)  # agent/... : calls and rows per rollout (means), rollouts with no reward (sum)
        self.keys += ["agent/calls_per_rollout", "agent/segments_per_rollout"] if self.agent else []
        self.sums = self.objective_sum + (["agent/faults"] if self.agent else [])
        self.bar = tqdm(total=cfg.all_steps, initial=start_step, desc="grpo", disable=rank != 0, dynamic_ncols=True)

    def row(self, step: int, rnd, info: dict, stats: dict, fetched: bool, t0: float, t1: float) -> tuple[dict, bool]:
        """This rank's metrics of the step, and whether any rank has been asked to stop (collectives)."""
        own: RolloutStats = info["own_gen"]
        versions = [b.policy_version for b in rnd.batches]
        row = {**round_metrics(rnd.batches), **stats, "wait_s": info["wait_s"], "gen_s": info["gen_s"],
               "skipped_groups": own.skipped_no_spread, "skipped_long_prompts": own.skipped_long_prompt,
               "rejected_batches": info["rejected_batches"], "lost_batches": info["lost_batches"],
               "staleness": sum((step - 1) - v for v in versions) / len(versions),
               "tokens_per_s": sum(b.num_completion_tokens() for b in rnd.batches) / max(time.time() - t1, 1e-9),
               "step_s": time.time() - t0, "round_pass": rnd.passes}
        row["staleness_max"] = max((step - 1) - v for v in versions)
        row["dropped_stale"] = info["dropped_stale"]
        row["ref_skipped_batches"] = info.get("ref_skipped_batches", 0)
        if self.agent:  # the faults the batches fetched this step carry (every fault of their producer's rounds)
            row["agent/faults"] = sum(sum(b.extra.get("agent_faults", [])) for b in rnd.batches) if fetched else 0
        from_ranks = sum(b.producer_id.startswith(RANK_PRODUCER) for b in rnd.batches)  # trained this step, by producer
        row["batches_from_ranks"], row["batches_from_workers"] = from_ranks, len(rnd.batches) - from_ranks
        row.update(memory_row(self.rank, self.world))
        if step == self.start_step + 1:
            row.update(self.setup_row)  # trainable parameters, full-weights size: once, in the first row
        mine = [int(i) for b in rnd.batches for i in b.extra.get("example_index", [])]  # what this rank trained on
        trained: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(trained, (mine, self.stop.asked))  # and: has any rank been asked to stop
        trained, stopping = agreed(trained)
        self.trained = trained
        if self.cfg.log_completions and fetched and step % self.cfg.log_completions_steps == 0:  # every rank
            rows = gather_rows(completion_rows(rnd.batches, self.tok, step))
            if self.completions is not None:
                self.completions.log(step, rows, self.metrics)
        self.totals["dropped_stale"] += info["dropped_stale"]
        add_tool_totals(self.totals, own.tools)  # what this rank's own rollouts called (the /status view)
        return row, stopping

    def reduce(self, step: int, row: dict, rnd) -> dict:
        """The row over every rank (a collective), with TRL's log_metric values of the reward functions."""
        once = list(self.setup_row) if step == self.start_step + 1 else []
        row = reduce_metrics(row, self.keys, SUM_KEYS + self.sums + mem_keys(self.world) + once, MAX_KEYS)
        row.update(reward_logged_metrics(rnd.batches, row))  # TRL's log_metric, from the reward functions
        return row

    def log(self, step: int, row: dict, get_lr) -> None:
        """Rank 0 writes the row (metrics.jsonl, TensorBoard, ...) every log_every steps; the bar moves on."""
        if self.rank == 0 and step % self.cfg.log_every == 0:
            row["lr"] = get_lr()[0]  # the DeepSpeed engine's, asked only when a row is written
            row["example_indices"] = self.trained  # per rank: the examples trained this step (exact-resume check)
            self.metrics.log(step, row)
            tools = {"tools": f"{row['tools/calls_per_completion']:.2f}"} if self.has_tools else {}
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", reward=f"{row.get('reward_mean', math.nan):.3f}",
                                 kl=f"{row['kl']:.4f}", **tools)  # tools: tool calls per completion
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.metrics:
            self.metrics.close()
