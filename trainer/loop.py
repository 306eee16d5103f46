"""The training loop on each DeepSpeed rank: one GRPO step per batch, metrics, eval, weight publishing.

A step is one optimizer update (trainer/objective/update.py): every mu-th step BatchSource (trainer/batches.py)
hands over grad_accum training batches of scored groups -> train_update computes per-token logprobs
(common/logprobs.py) and the GRPO loss (trainer/objective/grpo.py, off-policy weights from
trainer/objective/offpolicy.py) -> DeepSpeed backward per batch + one update -> metrics reduced over ranks
(trainer/run/step_metrics.py) -> rank 0 publishes the weights for the genonly workers (trainer/publish.py over
common/weights/sync.py). What a step reports (its row, completions.jsonl, the bar) is trainer/run/step_report.py:
the loop's body is the algorithm's step, and fits on a screen.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from common.config import GRPOConfig
from common.modeling import eos_ids, load_tokenizer, resolve_model_path
from common.run_record import drop_incomplete
from common.settings.gen_defaults import resolve_at_start, resolve_generation, unresolved
from common.settings.knobs import to_dict
from trainer import resume
from trainer.batches import RANK_PRODUCER, BatchSource, UnusableBatches
from trainer.checkpoint import save_hf, save_step, source_dtype
from trainer.data import run_data
from trainer.deepspeed_policy import build_engine, init_deepspeed
from trainer.dist import comm, nodes
from trainer.evaluate import CORRECTNESS_REWARDS
from trainer.objective.update import metric_keys, new_round, starts_round, train_update
from trainer.publish import Publisher
from trainer.rewards.scoring import RewardScorer
from trainer.run.completions import CompletionLog
from trainer.run.health import (
    EXIT_PEER_GONE,
    EXIT_UNUSABLE_BATCHES,
    EXIT_WEIGHTS_REFUSED,
    Heartbeat,
    Watchdog,
    WeightsRefused,
    write_diagnosis,
)
from trainer.run.requeue import EXIT_REQUEUE, StopRequest
from trainer.run.step_metrics import (
    model_summary,
)
from trainer.run.step_report import StepReport, round_info
from trainer.runtime import make_client, setup_logging
from trainer.tools import ToolBox

log = logging.getLogger("trainer")


def run_eval(model, tok, cfg: GRPOConfig, examples, lockstep: bool = False, scorer=None, toolbox=None) -> dict:
    """Greedy eval on the eval set, called by every rank at every ZeRO stage: rank r evaluates examples
    r, r + world, ... (disjoint shares covering the set) and the counts are summed, so the result is what one
    process evaluating the whole set gives. One rank alone would keep the others waiting in a collective past
    dist_timeout on a long eval (a 7B GSM8K eval). lockstep (ZeRO-3): the ranks generate together (synced
    generation: each forward gathers the weights from all ranks).
    scorer (the run's RewardScorer): eval_reward_mean and eval_reward/<name> from the run's reward functions, and
    eval_accuracy / eval_format only where a correctness reward / `format` is among them. Without it: GSM8K-style
    accuracy and format rate from the built-ins. toolbox: the run's tools, used in eval too (multi-turn, greedy);
    eval_tool_calls_per_completion then says how much the model called them."""
    from trainer.engines.hf import HFEngine
    from trainer.evaluate import evaluate
    if unresolved(cfg):  # a config built in code (runs resolve theirs at start: resolve_at_start)
        cfg, _ = resolve_generation(cfg, cuda=torch.cuda.is_available(), producer="rank")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if lockstep:
        model = HFEngine(model, tok, eos_ids(tok, model, chat=cfg.prompt_format != "r1zero"), temperature=1.0,
                         top_p=1.0, top_k=0, gen_batch_size=cfg.gen_batch_size, synced_gpus=True)
    res = evaluate(model, tok, examples[rank::world], system_prompt=cfg.system_prompt,
                   prompt_format=cfg.prompt_format, max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, batch_size=cfg.gen_batch_size, progress=False,
                   scorer=scorer, toolbox=toolbox, max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                   chat_template_kwargs=cfg.chat_template_kwargs)
    parts: list = [None] * world  # an object collective: NCCL and gloo alike, no tensor device to pick
    torch.distributed.all_gather_object(parts, (res["correct"], res["formatted"], res["n"], res["rewards"],
                                                res["reward_total"], res["reward_errors"], res.get("tool_calls")))
    n = sum(p[2] for p in parts)
    tools = {"eval_tool_calls_per_completion": sum(p[6] for p in parts) / max(n, 1)} if toolbox is not None else {}
    if scorer is None:
        correct, formatted = sum(p[0] for p in parts), sum(p[1] for p in parts)
        return {"eval_accuracy": correct / max(n, 1), "eval_format": formatted / max(n, 1), "eval_n": n, **tools}
    out = {"eval_n": n, "eval_reward_mean": sum(p[4] for p in parts) / max(n, 1), **tools}
    errors = sum(p[5] for p in parts)
    if errors:  # examples a reward failed on (left unscored; trainer/evaluate.py says which)
        out["eval_reward_errors"] = errors
    for name in scorer.names:  # per function: its mean where it applied, its share of completions scored > 0
        total, count, hits = (sum(p[3].get(name, [0.0, 0, 0])[i] for p in parts) for i in range(3))
        if count:
            out[f"eval_reward/{name}"] = total / count
        if name in CORRECTNESS_REWARDS and "eval_accuracy" not in out:
            out["eval_accuracy"] = hits / max(n, 1)
        if name == "format":
            out["eval_format"] = hits / max(n, 1)
    return out


# --------------------------------------------------------------------------- train
def train(cfg: GRPOConfig) -> None:
    """Run the rank; a failed collective ends it with one line naming the peer (exit 4), batches it can never
    use with one line naming why (exit 5), policy weights the ref server refuses with one line naming its
    limit and the knob (exit 6)."""
    started: list[Watchdog] = []  # the rank's watchdog, once it runs
    try:
        _train(cfg, started)
    except UnusableBatches as e:  # a producer whose batches this trainer can never use: say which, promptly
        log.error("%s", e)
        write_diagnosis(cfg.output_dir, f"rank {torch.distributed.get_rank()}: {e}")
        raise SystemExit(EXIT_UNUSABLE_BATCHES) from e
    except WeightsRefused as e:  # the ref server will not take the policy weights: the limit and the knob
        log.error("%s", e)
        write_diagnosis(cfg.output_dir, str(e))
        raise SystemExit(EXIT_WEIGHTS_REFUSED) from e
    except Exception as e:
        if not (started and _is_dist_error(e)):
            raise
        line = started[0].peer_diagnosis(e, grace=2.0)
        log.error("%s", line)
        write_diagnosis(cfg.output_dir, line)
        raise SystemExit(EXIT_PEER_GONE) from e


_is_dist_error = comm.is_dist_error  # gloo's and NCCL's words for a failed collective


def _train(cfg: GRPOConfig, started: list) -> None:
    from trainer.run.metrics import MetricsLogger

    deepspeed, rank, world, on_gpu = init_deepspeed(cfg)
    setup_logging(f"rank{rank}")
    cfg = resolve_at_start(cfg, log, f"rank{rank}", producer="rank", ranks=world)  # auto values, said
    torch.manual_seed(cfg.seed + rank)
    out = Path(cfg.output_dir)
    examples = run_data.train_examples(cfg)
    cfg.resolve_epochs(len(examples), world)  # num_train_epochs -> all_steps (and warmup_ratio), before it is used
    if cfg.num_train_epochs is not None and rank == 0:
        log.info("num_train_epochs %s over %d prompts: all_steps %d", cfg.num_train_epochs, len(examples),
                 cfg.all_steps)
    if nodes.is_node_leader():  # every host keeps its own run directory (no shared filesystem assumed)
        out.mkdir(parents=True, exist_ok=True)
        for p in drop_incomplete(out):  # an earlier attempt's save cut short: never resumed from, never loaded
            log.info("removed %s: a checkpoint an interrupted save left incomplete", p)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        resolve_model_path(cfg.model)
    torch.distributed.barrier()  # each host's leader builds the tiny model once; its other ranks find it cached
    model_path = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_path, cfg.load_options())
    engine, zero_stage, start_step = build_engine(cfg, deepspeed, model_path, on_gpu)
    policy = engine.module
    hf_dtype = source_dtype(model_path, cfg.load_options())  # HF checkpoints in the model's own dtype
    setup_row = model_summary(policy, rank)
    vocab = policy.get_output_embeddings().weight.shape[0] if zero_stage != 3 else policy.config.vocab_size

    peers: list = [None] * world  # (host, pid) of every rank: the watchdog names a peer that dies
    torch.distributed.all_gather_object(peers, (nodes.host_label(), os.getpid()))
    client = make_client(cfg, f"{RANK_PRODUCER}{rank}", "rank", host=peers[rank][0])
    client.wait_ready(timeout=300)
    eval_examples = run_data.eval_examples(cfg)  # held-out rows only: never the training rows
    scorer = RewardScorer.from_config(cfg)
    sampler = resume.rank_sampler(examples, cfg.seed, out / "ds", start_step, rank, world)
    stop_ids = eos_ids(tok, policy, chat=cfg.prompt_format != "r1zero")
    toolbox = ToolBox.from_config(cfg, tok)  # None without tools; its tool process is this rank's own
    source = BatchSource(cfg, client, policy, tok, sampler, scorer, stop_ids,
                         vocab, producer_id=f"{RANK_PRODUCER}{rank}", lockstep=zero_stage == 3, toolbox=toolbox)
    metrics = MetricsLogger(out, resume_step=start_step if cfg.resume else None, reporters=cfg.reporters(),
                            run_config=to_dict(cfg), wandb_project=cfg.wandb_project,
                            run_name=cfg.run_name) if rank == 0 else None
    completions = CompletionLog(out, start_step if cfg.resume else None, cfg.num_completions_to_print) \
        if rank == 0 and cfg.log_completions else None

    publisher = Publisher(cfg, client, policy, deepspeed, rank, zero_stage)
    publisher.publish(start_step)

    def maybe_eval(step: int) -> dict:
        res = run_eval(policy, tok, cfg, eval_examples, lockstep=zero_stage == 3, scorer=scorer,  # every rank
                       toolbox=toolbox)
        if rank == 0:
            log.info("eval at step %d: %s", step, ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in
                                                            res.items() if k != "eval_n") + f" (n={res['eval_n']})")
        return res

    stop = StopRequest(out)  # OUTPUT_DIR/stop_request: a checkpoint at the end of this step, then exit 75 (requeue)
    watchdog = Watchdog(cfg, client, rank, peers).start()
    started.append(watchdog)
    source.watchdog = watchdog  # says what the rank waits for
    totals = {"skipped_groups": 0, "dropped_stale": 0}  # cumulative, for the server's status table
    beat = lambda: {**totals, "skipped_groups": source.stall.skipped, "all_steps": cfg.all_steps}  # noqa: E731
    heartbeat = Heartbeat(client, cfg.heartbeat_s, lambda: watchdog.activity, beat).start()  # skipped: live
    if cfg.eval_before and start_step == 0 and eval_examples:
        watchdog.activity = "evaluating (eval_before)"
        res = maybe_eval(0)
        if metrics:
            metrics.log(0, {**res, "phase": "eval_before"})
        watchdog.stepped()
    report = StepReport(cfg, rank, world, start_step, setup_row, scorer.names, metric_keys(cfg), totals, metrics,
                        completions, tok, stop, toolbox)
    device = next(engine.module.parameters()).device

    def fetch(step: int, rnd):
        """The step's batches: a new generation round of grad_accum batches every mu-th step, else the round's."""
        if not starts_round(step, start_step, cfg.mu):
            return rnd, round_info([]), False  # a later pass over the round's batches: nothing fetched
        got = [source.next(policy_version=step - 1) for _ in range(cfg.grad_accum)]
        rnd, info = new_round([g[0] for g in got], cfg, device), round_info([g[1] for g in got])
        info["ref_skipped_batches"] = sum(b.ref_logps is None for b in rnd.batches)
        return rnd, info, True

    def checkpoint(step: int) -> None:
        watchdog.activity = f"saving the checkpoint of step {step}"
        states: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, resume.capture(source.sampler))
        if nodes.is_node_leader():  # each host's own copy, before `latest` moves to this tag
            resume.save_rank_states(out / "ds", f"step{step}", states)
        save_step(engine, tok, out, step, cfg, rank, zero_stage, hf_dtype)

    stopping, step, rnd = False, start_step, None
    while not stopping and step < cfg.all_steps:  # the GRPO step: get a batch, update, report, publish, eval, save
        step, t0 = step + 1, time.time()
        rnd, info, fetched = fetch(step, rnd)
        t1 = time.time()
        watchdog.activity = f"training step {step}"
        stats = train_update(engine, rnd, cfg)
        watchdog.stepped()
        watchdog.activity = f"exchanging the results of step {step} with the other ranks (collectives)"
        client.set_version(step)
        row, stopping = report.row(step, rnd, info, stats, fetched, t0, t1)
        if publisher.active and step % cfg.sync_steps == 0:
            watchdog.activity = f"publishing the weights of step {step}"
            row.update(publisher.publish(step))
        watchdog.activity = f"exchanging the results of step {step} with the other ranks (collectives)"
        row = report.reduce(step, row, rnd)
        if cfg.eval_steps and step % cfg.eval_steps == 0 and eval_examples:
            watchdog.activity = f"evaluating at step {step}"
            row.update(maybe_eval(step))
        report.log(step, row, engine.get_lr)
        if cfg.save_strategy == "steps" and (step % cfg.save_steps == 0 or step == cfg.all_steps or stopping):
            checkpoint(step)
    stopping = step < cfg.all_steps  # stopped for a requeue: no `final` yet
    if cfg.save_strategy == "steps" and not stopping:  # "no": a run that keeps no weights (save_options.py)
        watchdog.activity = "saving the final checkpoint"
        save_hf(engine, tok, out / "final", rank, zero_stage, hf_dtype, final=True)
    scorer.close()
    if toolbox is not None:
        toolbox.close()
    report.close()
    watchdog.stop()  # before the final barrier: a peer may exit as soon as it is passed
    heartbeat.stop("stopped for a requeue" if stopping else "done")
    log.info(f"stopped at step {step} for a requeue: checkpoint ds/step{step}" if stopping else
             f"training done: {cfg.all_steps} steps")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if stopping:
        raise SystemExit(EXIT_REQUEUE)
