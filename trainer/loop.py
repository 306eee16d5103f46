"""The training loop on each DeepSpeed rank: one GRPO step per batch, metrics, eval, weight publishing.

A step: BatchSource (trainer/batches.py) hands over scored groups -> train_step computes per-token
logprobs (common/logprobs.py) and the GRPO loss (trainer/grpo.py) -> DeepSpeed backward + step ->
metrics reduced over ranks (trainer/step_metrics.py) -> rank 0 publishes the weights for the genonly
workers (trainer/publish.py over common/weight_sync.py).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from common.config import GRPOConfig
from common.knobs import to_dict
from common.logprobs import chunk_count, sequence_logprobs
from common.modeling import eos_ids, load_tokenizer, resolve_model_path
from common.protocol import ScoredBatch
from trainer import comm, microbatch, resume
from trainer.batches import BatchSource
from trainer.checkpoint import save_hf, save_step, source_dtype
from trainer.data import ColumnSpec, load_examples
from trainer.engine import build_engine, init_deepspeed
from trainer.grpo import grpo_loss, loss_stats, mismatch_stats, reinforce_pp_advantages, tis_weights
from trainer.health import EXIT_PEER_GONE, Heartbeat, Watchdog, write_diagnosis
from trainer.microbatch import micro_batches_per_step, rows_per_step
from trainer.publish import Publisher
from trainer.rewards.scoring import RewardScorer
from trainer.rollout import RolloutStats
from trainer.runtime import make_client, setup_logging
from trainer.step_metrics import (
    MAX_KEYS,
    MEAN_KEYS,
    SUM_KEYS,
    batch_metrics,
    mem_keys,
    memory_row,
    model_summary,
    reduce_metrics,
)

log = logging.getLogger("trainer")


def train_step(engine, b: ScoredBatch, cfg: GRPOConfig) -> dict:
    """mu optimisation passes over one training batch, each in micro-batches of micro_batch_size rows whose
    gradients DeepSpeed accumulates into one optimizer update (trainer/microbatch.py); returns loss and
    diagnostics."""
    device = next(engine.module.parameters()).device
    mask = b.completion_mask().to(device)
    if cfg.mask_truncated and "truncated" in b.extra:
        keep = ~torch.tensor(b.extra["truncated"], dtype=torch.bool, device=device)
        mask = mask & keep[:, None]
    adv = b.advantages.to(device)
    if cfg.advantage_mode == "reinforce_pp":  # group-centred at generation; normalised over the step's batch here
        adv = reinforce_pp_advantages(adv, all_reduce=comm.all_reduce if torch.distributed.is_initialized() else None)
    gen = b.gen_logps.to(device) if (cfg.compute_gen_logps and b.gen_logps is not None) else None
    ref = b.ref_logps.to(device) if (cfg.beta > 0) else None
    micros = microbatch.split(b, mask, adv, gen, ref, cfg.micro_batch_size or b.num_rows, cfg.aggregation)
    if len(micros) != micro_batches_per_step(cfg):  # DeepSpeed's accumulation boundary counts micro-batches
        raise ValueError(f"training batch of {b.num_rows} rows makes {len(micros)} micro-batches of "
                         f"micro_batch_size={cfg.micro_batch_size}; train_batch_groups x num_pre_Q = "
                         f"{rows_per_step(cfg)} rows make {micro_batches_per_step(cfg)}")
    scale = dapo_scale(mask) if cfg.aggregation == "dapo" else 1.0  # the whole rank batch's share, once
    stats: dict = {}
    olds: list = [None] * len(micros)  # truncated IS: the trainer's own old logps (first pass) per micro-batch
    for _ in range(cfg.mu):
        seen = []
        for i, mb in enumerate(micros):
            logps, ent = sequence_logprobs(engine.module, mb.input_ids, mb.prompt_lens, mb.completion_lens,
                                           chunk_tokens=cfg.logp_chunk_tokens, with_entropy=True,
                                           min_chunks=agreed_chunks(engine.module, mb, cfg))
            logps = logps.float()
            if cfg.tis_cap is not None and mb.gen is not None and olds[i] is None:
                olds[i] = logps.detach()
            loss = micro_loss(logps, mb, olds[i], cfg) * (scale * mb.weight)
            engine.backward(loss * microbatch.backward_scale(len(micros)))
            engine.step()  # an optimizer update only after the step's last micro-batch (engine.py)
            seen.append((logps.detach(), ent, float(loss.detach())))
        if not stats:  # diagnostics of the first pass: the policy that saw this batch
            stats = step_stats(seen, micros, olds, b, mask, adv, gen, ref, cfg)
    return stats


def agreed_chunks(model, mb: microbatch.Micro, cfg: GRPOConfig) -> int:
    """Under ZeRO-3 each LM-head call gathers the head from every rank: all ranks make as many calls as the
    rank with the longest completions (common/logprobs.py pads with empty chunks). 0 otherwise."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return 0
    return comm.all_reduce_int(chunk_count(*mb.mask.shape, cfg.logp_chunk_tokens), "max")


def micro_loss(logps: torch.Tensor, mb: microbatch.Micro, old: torch.Tensor | None, cfg: GRPOConfig) -> torch.Tensor:
    """The GRPO loss of one micro-batch, normalised within it (the caller weights it into the batch's loss)."""
    level = cfg.importance_sampling_level
    weights = tis_weights(old, mb.gen, cfg.tis_cap) if old is not None else None
    return grpo_loss(logps, mb.ref, old if old is not None else mb.gen, mb.adv, mb.mask, beta=cfg.beta,
                     aggregation="token_mean" if cfg.aggregation == "dapo" else cfg.aggregation,
                     max_new_tokens=cfg.max_new_tokens, importance_sampling_level=level, is_weights=weights,
                     **_eps(cfg))


def _eps(cfg: GRPOConfig) -> dict:
    if cfg.importance_sampling_level == "sequence":
        return dict(eps_low=cfg.gspo_eps_low, eps_high=cfg.gspo_eps_high)
    return dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high)


def step_stats(seen: list, micros: list, olds: list, b: ScoredBatch, mask, adv, gen, ref, cfg: GRPOConfig) -> dict:
    """Whole-batch diagnostics from the first pass's micro-batches: KL, clipping, entropy, loss, mismatch."""
    B, T = mask.shape
    logps = microbatch.join([s[0] for s in seen], micros, B, T)
    ent = microbatch.join([s[1] for s in seen], micros, B, T)
    stats = loss_stats(logps, ref, gen, adv, mask, importance_sampling_level=cfg.importance_sampling_level,
                       **_eps(cfg))
    m = mask.float()
    stats["entropy"] = float((ent * m).sum() / m.sum().clamp(min=1))
    stats["loss"] = sum(s[2] for s in seen)  # the weighted micro losses add up to the batch's loss
    if gen is not None:  # train/inference mismatch (includes policy drift when the batch is stale)
        stats.update(mismatch_stats(logps, gen, mask))
    if all(o is not None for o in olds):
        weights = tis_weights(microbatch.join(olds, micros, B, T), gen, cfg.tis_cap)
        stats["tis_weight_mean"] = float((weights * m).sum() / m.sum().clamp(min=1))
    return stats


def dapo_scale(mask: torch.Tensor) -> float:
    """TRL's dapo: token sum / the token count of the whole global batch. DeepSpeed averages gradients over
    ranks, so a rank's token_mean (sum / local tokens) is scaled by local tokens * world / global tokens."""
    local = mask.sum().to(torch.float64).cpu()
    total = local.clone()
    comm.all_reduce(total)  # on the group's device (NCCL: CUDA), see trainer/comm.py
    return float(local * torch.distributed.get_world_size() / total.clamp(min=1))


def run_eval(model, tok, cfg: GRPOConfig, examples, lockstep: bool = False) -> dict:
    """Greedy accuracy on the eval set. lockstep (ZeRO-3): every rank evaluates its shard with synced
    generation (each forward gathers the weights from all ranks) and the counts are summed."""
    from trainer.engines.hf import HFEngine
    from trainer.evaluate import evaluate
    if lockstep:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        examples = examples[rank::world]
        model = HFEngine(model, tok, eos_ids(tok, model, chat=cfg.prompt_format != "r1zero"), temperature=1.0,
                         top_p=1.0, top_k=0, gen_batch_size=cfg.gen_batch_size, synced_gpus=True)
    res = evaluate(model, tok, examples, system_prompt=cfg.system_prompt, prompt_format=cfg.prompt_format,
                   max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, batch_size=cfg.gen_batch_size, progress=False)
    counts = [(res["accuracy"] * res["n"], res["format_rate"] * res["n"], res["n"])]
    if lockstep:
        mine, counts = counts[0], [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(counts, mine)
    correct, formatted, n = (sum(c[i] for c in counts) for i in range(3))
    return {"eval_accuracy": correct / max(n, 1), "eval_format": formatted / max(n, 1), "eval_n": n}


# --------------------------------------------------------------------------- train
def train(cfg: GRPOConfig) -> None:
    """Run the rank; a failed collective ends it with one line naming the peer (exit 4)."""
    started: list[Watchdog] = []  # the rank's watchdog, once it runs
    try:
        _train(cfg, started)
    except Exception as e:
        if not (started and _is_dist_error(e)):
            raise
        line = started[0].peer_diagnosis(e, grace=2.0)
        log.error("%s", line)
        write_diagnosis(cfg.output_dir, line)
        raise SystemExit(EXIT_PEER_GONE) from e


_is_dist_error = comm.is_dist_error  # gloo's and NCCL's words for a failed collective


def _train(cfg: GRPOConfig, started: list) -> None:
    from tqdm import tqdm

    from trainer.metrics import MetricsLogger

    deepspeed, rank, world, on_gpu = init_deepspeed(cfg)
    setup_logging(f"rank{rank}")
    torch.manual_seed(cfg.seed + rank)
    out = Path(cfg.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        resolve_model_path(cfg.model)
    torch.distributed.barrier()  # rank 0 builds the tiny model once; the others then find it cached
    model_path = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_path)
    engine, zero_stage, start_step = build_engine(cfg, deepspeed, model_path, on_gpu)
    policy = engine.module
    hf_dtype = source_dtype(model_path)  # HF checkpoints in the model's own dtype
    setup_row = model_summary(policy, rank)
    vocab = policy.get_output_embeddings().weight.shape[0] if zero_stage != 3 else policy.config.vocab_size

    peers: list = [None] * world  # (host, pid) of every rank: the watchdog names a peer that dies
    torch.distributed.all_gather_object(peers, (os.uname().nodename, os.getpid()))
    client = make_client(cfg, f"trainer-rank{rank}", "rank")
    client.wait_ready(timeout=300)
    columns = ColumnSpec.from_config(cfg)
    examples = load_examples(cfg.data, split=cfg.data_split, limit=cfg.data_limit, columns=columns)
    eval_examples = load_examples(cfg.data, split=cfg.eval_split, limit=cfg.eval_limit, columns=columns) \
        if (cfg.eval_steps or cfg.eval_before) else []
    scorer = RewardScorer.from_config(cfg)
    sampler = resume.rank_sampler(examples, cfg.seed, out / "ds", start_step, rank, world)
    stop_ids = eos_ids(tok, policy, chat=cfg.prompt_format != "r1zero")
    source = BatchSource(cfg, client, policy, tok, sampler, scorer, stop_ids,
                         vocab, producer_id=f"trainer-rank{rank}", lockstep=zero_stage == 3)
    metrics = MetricsLogger(out, resume_step=start_step if cfg.resume else None, use_wandb=cfg.wandb,
                            run_config=to_dict(cfg)) if rank == 0 else None

    publisher = Publisher(cfg, client, policy, deepspeed, rank, zero_stage)
    publisher.publish(start_step)

    def maybe_eval(step: int) -> dict:
        lockstep = zero_stage == 3  # rank 0 alone would wait forever for the others' weight shards
        res = run_eval(policy, tok, cfg, eval_examples, lockstep) if (rank == 0 or lockstep) else {}
        torch.distributed.barrier()
        if rank == 0:
            log.info("eval at step %d: accuracy %.3f format %.3f", step, res["eval_accuracy"], res["eval_format"])
        return res

    watchdog = Watchdog(cfg, client, rank, peers).start()
    started.append(watchdog)
    source.watchdog = watchdog  # says what the rank waits for
    totals = {"skipped_groups": 0, "dropped_stale": 0}  # cumulative, for the server's status table
    heartbeat = Heartbeat(client, cfg.heartbeat_s, lambda: watchdog.activity, lambda: dict(totals)).start()
    if cfg.eval_before and start_step == 0 and eval_examples:
        watchdog.activity = "evaluating (eval_before)"
        res = maybe_eval(0)
        if metrics:
            metrics.log(0, {**res, "phase": "eval_before"})
        watchdog.stepped()

    keys = MEAN_KEYS + [f"reward/{name}" for name in scorer.names]
    keys += ["overlong_penalty"] if cfg.overlong_buffer > 0 else []
    bar = tqdm(total=cfg.all_steps, initial=start_step, desc="grpo", disable=rank != 0, dynamic_ncols=True)
    for step in range(start_step + 1, cfg.all_steps + 1):
        t0 = time.time()
        batch, info = source.next(policy_version=step - 1)
        t1 = time.time()
        watchdog.activity = f"training step {step}"
        stats = train_step(engine, batch, cfg)
        watchdog.stepped()
        watchdog.activity = f"exchanging the results of step {step} with the other ranks (collectives)"
        client.set_version(step)
        own: RolloutStats = info["own_gen"]
        row = {**batch_metrics(batch), **stats, "wait_s": info["wait_s"], "gen_s": info["gen_s"],
               "skipped_groups": own.skipped_no_spread, "skipped_long_prompts": own.skipped_long_prompt,
               "rejected_batches": info["rejected_batches"], "lost_batches": info["lost_batches"],
               "staleness": (step - 1) - batch.policy_version,
               "tokens_per_s": batch.num_completion_tokens() / max(time.time() - t1, 1e-9),
               "step_s": time.time() - t0}
        row["staleness_max"] = row["staleness"]  # one batch per rank per step: its staleness
        row["dropped_stale"] = info["dropped_stale"]
        row.update(memory_row(rank, world))
        if step == start_step + 1:
            row.update(setup_row)  # trainable parameters, full-weights size: once, in the first row
        mine = [int(i) for i in batch.extra.get("example_index", [])]  # what this rank trained on
        trained: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(trained, mine)
        totals["skipped_groups"] += own.skipped_no_spread
        totals["dropped_stale"] += info["dropped_stale"]
        if publisher.active and step % cfg.sync_steps == 0:
            watchdog.activity = f"publishing the weights of step {step}"
            row.update(publisher.publish(step))
        watchdog.activity = f"exchanging the results of step {step} with the other ranks (collectives)"
        once = list(setup_row) if step == start_step + 1 else []
        row = reduce_metrics(row, keys, SUM_KEYS + mem_keys(world) + once, MAX_KEYS)
        if cfg.eval_steps and step % cfg.eval_steps == 0 and eval_examples:
            watchdog.activity = f"evaluating at step {step}"
            row.update(maybe_eval(step))
        if rank == 0 and step % cfg.log_every == 0:
            row["lr"] = engine.get_lr()[0]
            row["example_indices"] = trained  # per rank: the examples trained this step (exact-resume check)
            metrics.log(step, row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl']:.4f}")
        bar.update(1)
        if step % cfg.save_steps == 0 or step == cfg.all_steps:
            watchdog.activity = f"saving the checkpoint of step {step}"
            states: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, resume.capture(source.sampler))
            if rank == 0:  # before DeepSpeed moves `latest` to this tag
                resume.save_rank_states(out / "ds", f"step{step}", states)
            save_step(engine, tok, out, step, cfg, rank, zero_stage, hf_dtype)
    watchdog.activity = "saving the final checkpoint"
    save_hf(engine, tok, out / "final", rank, zero_stage, hf_dtype, final=True)
    scorer.close()
    bar.close()
    if metrics:
        metrics.close()
    watchdog.stop()  # before the final barrier: a peer may exit as soon as it is passed
    heartbeat.stop("done")
    log.info("training done: %d steps", cfg.all_steps)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
