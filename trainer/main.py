"""GRPO trainer entry point.

    deepspeed trainer/main.py [--config FILE] [--key value ...]      # train (DeepSpeed ranks)
    python trainer/main.py genonly [--config FILE] [--key value ...]  # generate-only worker

One training step on a rank: pull scored group(s) from the ref server (generating and
uploading its own when none is ready), compute per-token logprobs of the completions,
the GRPO loss (trainer/grpo.py) and take an optimizer step through DeepSpeed.
"""
from __future__ import annotations

import os
import sys

# `deepspeed trainer/main.py` puts trainer/ first on sys.path, where our module names
# (data, evaluate, metrics...) would shadow same-named libraries. Packages come from `pip install -e .`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from common.client import RefClient, RefServerError  # noqa: E402
from common.weight_sync import WeightSync  # noqa: E402
from common.config import GRPOConfig, load_config, to_dict  # noqa: E402
from common.logprobs import sequence_logprobs  # noqa: E402
from common.modeling import eos_ids, load_model, load_tokenizer, resolve_model_path  # noqa: E402
from common.protocol import ProtocolError, ScoredBatch, collate  # noqa: E402
from trainer.data import load_examples, PromptSampler  # noqa: E402
from trainer.grpo import grpo_loss, loss_stats  # noqa: E402
from trainer.rewards import load_reward_fns  # noqa: E402
from trainer.rollout import RolloutStats, generate_batches  # noqa: E402

log = logging.getLogger("trainer")


def setup_logging(tag: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{tag}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True)


def make_client(cfg: GRPOConfig) -> RefClient:
    token = cfg.ref_token or os.environ.get("GRPO_REF_TOKEN")
    return RefClient([u for u in cfg.ref_server.split(",") if u], token=token, timeout=cfg.ref_timeout)


# --------------------------------------------------------------------------- DeepSpeed setup
def ds_config_for(cfg: GRPOConfig, on_gpu: bool) -> dict:
    """ds_config.json with the fields this config owns filled in (one source of truth for each knob)."""
    ds = json.loads(Path(cfg.ds_config).read_text())
    ds.pop("train_batch_size", None)  # derived: micro (1 training batch) x accumulation x world
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["gradient_clipping"] = cfg.grad_clip
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt.setdefault("params", {}).update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if not on_gpu:
        opt["params"]["torch_adam"] = True  # no fused-op compilation on CPU
    if cfg.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = cfg.zero_stage
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = bool(on_gpu and torch.cuda.is_bf16_supported())
    return ds


def lr_lambda(cfg: GRPOConfig):
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            total = max(1, cfg.all_steps * cfg.mu - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / total)))
        return 1.0
    return f


def init_deepspeed(cfg: GRPOConfig):
    import deepspeed

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 40 s gcc build of the shm op
    deepspeed.init_distributed(dist_backend=None if on_gpu else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    return deepspeed, rank, world, on_gpu


# --------------------------------------------------------------------------- checkpoints
def save_hf(engine, tokenizer, out: Path, rank: int, zero_stage: int) -> None:
    """HF directory loadable with from_pretrained. Under ZeRO-3 the shards are gathered first (all ranks)."""
    import deepspeed

    model = engine.module
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if rank == 0:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    elif rank == 0:
        state = None
    if rank == 0:
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        log.info("saved HF checkpoint %s", out)
    torch.distributed.barrier()


# --------------------------------------------------------------------------- a training batch
def check_scored(b: ScoredBatch, cfg: GRPOConfig, vocab_size: int) -> None:
    """What /get returned must fit this trainer: reject it loudly, never train on garbage."""
    if cfg.beta > 0 and b.ref_logps is None:
        raise ProtocolError(f"scored batch {b.batch_id} has no ref_logps but beta={cfg.beta}")
    if int(b.input_ids.max()) >= vocab_size:
        raise ProtocolError(f"scored batch {b.batch_id} has token ids beyond the policy vocab ({vocab_size})")
    if int(b.completion_lens.max()) > cfg.max_new_tokens:
        raise ProtocolError(f"scored batch {b.batch_id} has completions longer than max_new_tokens")


class BatchSource:
    """Yields training batches: scored groups from the server, generating our own when none is ready."""

    def __init__(self, cfg, client, model, tokenizer, sampler, reward_fns, eos, vocab_size, producer_id):
        self.cfg, self.client, self.model, self.tok = cfg, client, model, tokenizer
        self.sampler, self.reward_fns, self.eos, self.vocab = sampler, reward_fns, eos, vocab_size
        self.producer_id = producer_id
        self.in_flight = 0  # batches we uploaded and have not seen come back (any rank may take them)
        self.outages_at_upload = 0  # client.outages when we last uploaded: a later outage means a server died

    def next(self, policy_version: int) -> tuple[ScoredBatch, dict]:
        cfg = self.cfg
        groups: list[ScoredBatch] = []
        info = {"wait_s": 0.0, "gen_s": 0.0, "rejected_batches": 0, "dropped_stale": 0, "lost_batches": 0}
        gen = RolloutStats()
        last_note = time.time()
        idle_since = time.time()
        while len(groups) < cfg.train_batch_groups:
            # Wait briefly when something we uploaded is being scored; with workers, poll in slices.
            wait = 1.0 if self.in_flight > 0 else (2.0 if cfg.num_gen_workers else 0.0)
            t0 = time.time()
            b = self.client.get(timeout=wait)
            info["wait_s"] += time.time() - t0
            if b is not None:
                try:
                    check_scored(b, cfg, self.vocab)
                except ProtocolError as e:
                    log.error("rejected scored batch: %s", e)
                    info["rejected_batches"] += 1
                    continue
                if b.producer_id == self.producer_id:
                    self.in_flight = max(0, self.in_flight - 1)
                if policy_version - b.policy_version > cfg.max_staleness:
                    info["dropped_stale"] += 1  # generated by a policy too old to learn from safely
                    continue
                groups.append(b)
                idle_since = time.time()
                continue
            if self.in_flight > 0 and self._server_busy():
                continue  # our uploads are still queued or being scored: keep waiting for them
            if self.in_flight and self.client.outages != self.outages_at_upload:
                # the server was unreachable since our uploads: they died with it; count them and generate anew
                log.warning("%d uploaded batch(es) lost with the ref server; generating new ones", self.in_flight)
                info["lost_batches"] += self.in_flight
            self.in_flight = 0  # nothing pending: what we uploaded went to another rank (or was lost)
            if cfg.num_gen_workers == 0 or (cfg.get_wait > 0 and time.time() - idle_since > cfg.get_wait):
                t0 = time.time()
                batches, st = generate_batches(self.model, self.tok, self.sampler.next_batch(cfg.Q_batch_size), cfg,
                                               self.reward_fns, self.eos, policy_version, self.producer_id)
                info["gen_s"] += time.time() - t0
                _merge_stats(gen, st)
                for rb in batches:
                    self.client.upload(rb)
                self.in_flight += len(batches)
                self.outages_at_upload = self.client.outages
                idle_since = time.time()
            elif time.time() - last_note > 30:
                log.info("waiting for scored batches from genonly workers (%.0f s so far)", info["wait_s"])
                last_note = time.time()
        info["own_gen"] = gen
        return collate(groups), info

    def _server_busy(self) -> bool:
        try:
            q = self.client.health().get("queues", {})
        except RefServerError:
            return False
        return bool(q.get("input", 0) or q.get("scoring", False))


def _merge_stats(acc: RolloutStats, st: RolloutStats) -> None:
    for k in ("groups", "skipped_no_spread", "skipped_long_prompt", "completions", "completion_tokens", "seconds"):
        setattr(acc, k, getattr(acc, k) + getattr(st, k))
    acc.rewards.extend(st.rewards)
    for k, v in st.components.items():
        acc.components.setdefault(k, []).extend(v)


def batch_metrics(b: ScoredBatch) -> dict:
    """Reward metrics of the batch trained on (its rollouts came from whichever producer)."""
    out = {}
    if b.rewards is not None:
        out["reward_mean"] = float(b.rewards.mean())
        out["reward_std"] = float(b.rewards.std()) if b.rewards.numel() > 1 else 0.0
    comps = b.extra.get("components", {})
    if "correct" in comps:
        out["correct_rate"] = sum(v > 0 for v in comps["correct"]) / max(len(comps["correct"]), 1)
    if "format" in comps:
        out["format_rate"] = sum(v > 0 for v in comps["format"]) / max(len(comps["format"]), 1)
    out["completion_len"] = float(b.completion_lens.float().mean())
    return out


def train_step(engine, b: ScoredBatch, cfg: GRPOConfig) -> dict:
    """mu optimisation passes over one training batch; returns loss and diagnostics."""
    device = next(engine.module.parameters()).device
    mask = b.completion_mask().to(device)
    if cfg.mask_truncated and "truncated" in b.extra:
        keep = ~torch.tensor(b.extra["truncated"], dtype=torch.bool, device=device)
        mask = mask & keep[:, None]
    adv = b.advantages.to(device)
    gen = b.gen_logps.to(device) if (cfg.compute_gen_logps and b.gen_logps is not None) else None
    ref = b.ref_logps.to(device) if (cfg.beta > 0) else None
    stats: dict = {}
    for _ in range(cfg.mu):
        logps, ent = sequence_logprobs(engine.module, b.input_ids, b.prompt_lens, b.completion_lens,
                                       chunk_tokens=cfg.logp_chunk_tokens, with_entropy=True)
        logps = logps.float()
        loss = grpo_loss(logps, ref, gen, adv, mask, beta=cfg.beta, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                         aggregation=cfg.aggregation, max_new_tokens=cfg.max_new_tokens)
        engine.backward(loss)
        engine.step()
        if not stats:  # diagnostics of the first pass: the policy that saw this batch
            stats = loss_stats(logps, ref, gen, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
            m = mask.float()
            stats["entropy"] = float((ent * m).sum() / m.sum().clamp(min=1))
            stats["loss"] = float(loss.detach())
    return stats


def reduce_metrics(d: dict, mean: list[str], total: list[str], most: list[str]) -> dict:
    """Combine per-rank metrics: means, sums (counts, rank-0-only figures) and maxima."""
    dist = torch.distributed
    vals = lambda keys: torch.tensor([float(d.get(k, 0.0)) for k in keys], dtype=torch.float64)  # noqa: E731
    m, t, x = vals(mean), vals(total), vals(most)
    dist.all_reduce(m)
    dist.all_reduce(t)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    m /= dist.get_world_size()
    return {**dict(zip(mean, m.tolist())), **dict(zip(total, t.tolist())), **dict(zip(most, x.tolist()))}


def run_eval(model, tok, cfg: GRPOConfig, examples) -> dict:
    from trainer.evaluate import evaluate
    res = evaluate(model, tok, examples, system_prompt=cfg.system_prompt,
                   max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                   max_prompt_length=cfg.max_prompt_length, batch_size=cfg.gen_batch_size, progress=False)
    return {"eval_accuracy": res["accuracy"], "eval_format": res["format_rate"], "eval_n": res["n"]}


# --------------------------------------------------------------------------- train
def train(cfg: GRPOConfig) -> None:
    from tqdm import tqdm
    from trainer.metrics import MetricsLogger

    deepspeed, rank, world, on_gpu = init_deepspeed(cfg)
    setup_logging(f"rank{rank}")
    torch.manual_seed(cfg.seed + rank)
    out = Path(cfg.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if rank == 0:
        resolve_model_path(cfg.model)
    torch.distributed.barrier()  # rank 0 builds the tiny model once; the others then find it cached
    model_path = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_path)
    model = load_model(model_path, device="cpu", dtype="float32", trainable=True)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    ds_cfg = ds_config_for(cfg, on_gpu)
    zero_stage = int(ds_cfg.get("zero_optimization", {}).get("stage", 0))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)))
    policy = engine.module
    vocab = policy.get_output_embeddings().weight.shape[0] if zero_stage != 3 else policy.config.vocab_size

    start_step = 0
    if cfg.resume:
        path, client_state = engine.load_checkpoint(str(out / "ds"))
        if path is None:
            log.info("--resume: no DeepSpeed checkpoint in %s, starting from step 0", out / "ds")
        else:
            start_step = int(client_state["step"])
            log.info("resumed from %s at step %d", path, start_step)

    client = make_client(cfg)
    client.wait_ready(timeout=300)
    examples = load_examples(cfg.data, split=cfg.data_split, limit=cfg.data_limit)
    eval_examples = load_examples(cfg.data, split=cfg.eval_split, limit=cfg.eval_limit) \
        if (cfg.eval_steps or cfg.eval_before) else []
    sampler = PromptSampler(examples, seed=cfg.seed + 7919 * start_step, shard=rank, num_shards=world)
    source = BatchSource(cfg, client, policy, tok, sampler, load_reward_fns(cfg.reward_fns), eos_ids(tok, policy),
                         vocab, producer_id=f"trainer-rank{rank}")
    metrics = MetricsLogger(out, resume_step=start_step if cfg.resume else None, use_wandb=cfg.wandb,
                            run_config=to_dict(cfg)) if rank == 0 else None

    syncer = None
    if cfg.num_gen_workers > 0 and cfg.sync_steps > 0:
        syncer = WeightSync(client=None if cfg.sync_dir else client, sync_dir=cfg.sync_dir)

    def publish_rank0(version: int) -> tuple[float, int]:
        try:
            return syncer.publish(policy, version)
        except RefServerError as e:
            if e.status != 409:
                raise
            # Resumed while the server kept weights of a later step from before the crash: it accepts
            # only newer versions, so publishing picks up again once the step count passes them.
            log.warning("policy v%d not published (%s); workers keep the server's weights until a newer step",
                        version, e.message)
            return 0.0, 0

    def publish(version: int) -> dict:
        """Rank 0 publishes the live weights (gathered under ZeRO-3, which needs every rank)."""
        if syncer is None:
            return {}
        if zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
                res = publish_rank0(version) if rank == 0 else (0.0, 0)
        else:
            res = publish_rank0(version) if rank == 0 else (0.0, 0)
        return {"sync_s": res[0], "sync_mb": res[1] / 1e6}

    publish(start_step)

    def maybe_eval(step: int) -> dict:
        res = run_eval(policy, tok, cfg, eval_examples) if rank == 0 else {}
        torch.distributed.barrier()
        if rank == 0:
            log.info("eval at step %d: accuracy %.3f format %.3f", step, res["eval_accuracy"], res["eval_format"])
        return res

    if cfg.eval_before and start_step == 0 and eval_examples:
        res = maybe_eval(0)
        if metrics:
            metrics.log(0, {**res, "phase": "eval_before"})

    keys = ["loss", "reward_mean", "reward_std", "correct_rate", "format_rate", "kl", "clip_frac", "ratio_mean",
            "entropy", "completion_len", "tokens_per_s", "wait_s", "gen_s", "step_s", "staleness"]
    sum_keys = ["skipped_groups", "skipped_long_prompts", "rejected_batches", "dropped_stale", "lost_batches",
                "sync_s", "sync_mb"]
    bar = tqdm(total=cfg.all_steps, initial=start_step, desc="grpo", disable=rank != 0, dynamic_ncols=True)
    for step in range(start_step + 1, cfg.all_steps + 1):
        t0 = time.time()
        batch, info = source.next(policy_version=step - 1)
        t1 = time.time()
        stats = train_step(engine, batch, cfg)
        own: RolloutStats = info["own_gen"]
        row = {**batch_metrics(batch), **stats, "wait_s": info["wait_s"], "gen_s": info["gen_s"],
               "skipped_groups": own.skipped_no_spread, "skipped_long_prompts": own.skipped_long_prompt,
               "rejected_batches": info["rejected_batches"], "lost_batches": info["lost_batches"],
               "staleness": (step - 1) - batch.policy_version,
               "tokens_per_s": batch.num_completion_tokens() / max(time.time() - t1, 1e-9),
               "step_s": time.time() - t0}
        row["staleness_max"] = row["staleness"]  # one batch per rank per step: its staleness
        row["dropped_stale"] = info["dropped_stale"]
        if syncer is not None and step % cfg.sync_steps == 0:
            row.update(publish(step))
        row = reduce_metrics(row, keys, sum_keys, ["staleness_max"])
        if cfg.eval_steps and step % cfg.eval_steps == 0 and eval_examples:
            row.update(maybe_eval(step))
        if rank == 0 and step % cfg.log_every == 0:
            row["lr"] = engine.get_lr()[0]
            metrics.log(step, row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl']:.4f}")
        bar.update(1)
        if step % cfg.save_steps == 0 or step == cfg.all_steps:
            engine.save_checkpoint(str(out / "ds"), tag=f"step{step}", client_state={"step": step})
            if step % cfg.save_steps == 0:
                save_hf(engine, tok, out / f"step_{step}", rank, zero_stage)
    save_hf(engine, tok, out / "final", rank, zero_stage)
    bar.close()
    if metrics:
        metrics.close()
    log.info("training done: %d steps", cfg.all_steps)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- genonly worker
def genonly(cfg: GRPOConfig) -> None:
    """Generate-only worker: produce and upload rollouts until stopped (SIGTERM/SIGINT end it cleanly)."""
    setup_logging(f"worker{cfg.worker_id}")
    stop = {"now": False}

    def on_signal(signum, _frame):
        log.info("signal %d: finishing this round, then exiting", signum)
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    torch.manual_seed(cfg.seed + 1000 + cfg.worker_id)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, device=cfg.device, dtype="auto")
    client = make_client(cfg)
    client.wait_ready(timeout=300)
    examples = load_examples(cfg.data, split=cfg.data_split, limit=cfg.data_limit)
    sampler = PromptSampler(examples, seed=cfg.seed + 1000 + cfg.worker_id)
    reward_fns, eos = load_reward_fns(cfg.reward_fns), eos_ids(tok, model)
    syncer = WeightSync(client=None if cfg.sync_dir else client, sync_dir=cfg.sync_dir) if cfg.sync_steps else None
    rounds = uploaded = 0
    t_start = time.time()
    while not stop["now"] and (cfg.worker_rounds == 0 or rounds < cfg.worker_rounds):
        try:
            q = client.health(retry=True).get("queues", {})  # an outage: backoff, logged once by the client
            if q.get("input", 0) + q.get("output", 0) >= cfg.worker_max_queued:
                time.sleep(0.2)  # the trainer has enough to chew on; generate later, with newer weights
                continue
            if syncer is not None:  # between rounds: swap in newer policy weights, if any
                syncer.follow(model)
            version = syncer.version if syncer is not None and syncer.version is not None else 0
            batches, st = generate_batches(model, tok, sampler.next_batch(cfg.Q_batch_size), cfg, reward_fns, eos,
                                           policy_version=version, producer_id=f"worker{cfg.worker_id}")
            for rb in batches:
                if stop["now"]:
                    break
                client.upload(rb)
                uploaded += 1
        except RefServerError as e:  # the client already retried with backoff; keep going, say so
            log.warning("ref server problem, retrying next round: %s", e)
            time.sleep(1.0)
            continue
        rounds += 1
        if rounds % 10 == 0:
            log.info("round %d: %d batches uploaded, %d groups skipped (no spread), %.1f completions/s", rounds,
                     uploaded, st.skipped_no_spread, st.completions / max(st.seconds, 1e-9))
    log.info("worker done: %d rounds, %d batches uploaded in %.0f s", rounds, uploaded, time.time() - t_start)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "train"
    if argv and argv[0] == "genonly":
        mode, argv = "genonly", argv[1:]
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    cfg = load_config(GRPOConfig, argv, prog="trainer/main.py [genonly]", ignore_unknown=("local_rank",))
    if mode == "genonly":
        genonly(cfg)
    else:
        train(cfg)


if __name__ == "__main__":
    main()
