"""Where a rank's next training batch comes from: scored groups from the ref server, or rollouts it
generates and uploads itself when none is ready (no genonly workers, or they are too slow)."""
from __future__ import annotations

import logging
import time

from common.config import GRPOConfig
from common.wire.client import RefServerError
from common.wire.protocol import ProtocolError, ScoredBatch, collate
from trainer.agents.rollout import AgentRollouts
from trainer.dist.comm import all_reduce_int
from trainer.engines.hf import HFEngine
from trainer.objective.update import truncated_mask
from trainer.rollout import generate_batches
from trainer.run.rollout_stats import RolloutStats
from trainer.run.stall import StallReporter
from trainer.run.start_order import WorkersStarting

RANK_PRODUCER = "trainer-rank"  # producer_id prefix of the batches a rank generates itself (+ its rank)

log = logging.getLogger("trainer")


def check_scored(b: ScoredBatch, cfg: GRPOConfig, vocab_size: int) -> None:
    """What /get returned must fit this trainer: reject it loudly, never train on garbage."""
    if cfg.beta > 0 and b.ref_logps is None:
        raise ProtocolError(f"scored batch {b.batch_id} has no ref_logps but beta={cfg.beta}")
    if int(b.input_ids.max()) >= vocab_size:
        raise ProtocolError(f"scored batch {b.batch_id} has token ids beyond the policy vocab ({vocab_size})")
    if int(b.completion_lens.max()) > cfg.max_new_tokens:
        raise ProtocolError(f"scored batch {b.batch_id} has completions longer than max_new_tokens")
    t = float(b.logp_temperature)  # its ref (and engine) logprobs are at this T
    if (cfg.beta > 0 or b.gen_logps is not None) and abs(t - cfg.logprob_temperature()) > 1e-9:
        raise ProtocolError(f"scored batch {b.batch_id} has logprobs at temperature {t}, this trainer computes "
                            f"its own at {cfg.logprob_temperature()} (temperature / logp_temperature differ "
                            f"between producer and trainer)")
    if cfg.mask_truncated and "truncated" in b.extra:
        truncated_mask(b)  # one bool per completion (checked at decode too; here for what this trainer reads)


class UnusableBatches(RuntimeError):
    """Every scored batch for `max_rejected_batches` in a row was rejected: a producer's settings do not fit this
    trainer's (the message names the last reason). Ends the rank (trainer/loop.py: exit 5)."""


def usable_version(batch_version: int, current: int, max_staleness: int) -> bool:
    """A batch is trained on only if its policy is at most max_staleness versions old. A version *newer*
    than ours comes from steps lost in a crash (a resume went back to the last checkpoint): those weights
    no longer exist, so such a batch is dropped too."""
    return 0 <= current - batch_version <= max_staleness


def is_stale(cfg: GRPOConfig, policy_version: int, b: ScoredBatch) -> bool:
    """Not usable_version. With sync_steps=0 workers never get new weights: their batches say version 0
    forever, so versions are not compared for them (else every worker batch is dropped after step
    max_staleness + 1)."""
    if cfg.sync_steps == 0 and not b.producer_id.startswith(RANK_PRODUCER):
        return False
    return not usable_version(b.policy_version, policy_version, cfg.max_staleness)


class BatchSource:
    """Yields training batches: scored groups from the server, generating our own when none is ready."""

    def __init__(self, cfg, client, model, tokenizer, sampler, scorer, eos, vocab_size, producer_id,
                 lockstep: bool = False, toolbox=None):
        self.cfg, self.client, self.model, self.tok = cfg, client, model, tokenizer
        self.toolbox = toolbox  # trainer/tools ToolBox (the rank's own, closed by the rank): multi-turn rollouts
        self.sampler, self.scorer, self.eos, self.vocab = sampler, scorer, eos, vocab_size
        self.producer_id = producer_id
        # Ranks generate from the live DeepSpeed module with HF: it already holds the exact current weights,
        # where a vLLM engine per rank would hold a second copy and need a weight swap every step.
        # lockstep (ZeRO-3): ranks decide together to generate, and generate with synced_gpus (see _next_lockstep)
        self.lockstep = lockstep
        self.engine = HFEngine(model, tokenizer, eos, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                               gen_batch_size=cfg.gen_batch_size, synced_gpus=lockstep,
                               extra=cfg.sampling_extras(),
                               seq_len=cfg.max_prompt_length + cfg.max_new_tokens,  # batches to its GPU's memory
                               # logprobs from generate's own logits: no second forward (issue 62)
                               logprob_temperature=cfg.logprob_temperature() if cfg.compute_gen_logps else None)
        # `agent`: the user's agent makes this rank's own rollouts too, against an endpoint on this engine (not
        # under ZeRO-3 lockstep: refused at start, common/settings/agent_options.py)
        self.agents = AgentRollouts.from_config(cfg, self.engine, tokenizer)
        self.in_flight = 0  # batches we uploaded and have not seen come back (any rank may take them)
        self.outages_at_upload = 0  # client.outages when we last uploaded: a later outage means a server died
        self.stall = StallReporter.from_config(producer_id, cfg)  # says so when every group is skipped; exit 7
        self.idle_since = time.time()
        self.rejected_in_a_row = 0  # reset by a usable batch; max_rejected_batches of them end the run
        self.starting = WorkersStarting(cfg, client)  # workers on our GPU still starting: not generating meanwhile
        self.watchdog = None  # trainer/run/health.py Watchdog: told what we wait for (its stall diagnosis says it)

    def _doing(self, what: str) -> None:
        if self.watchdog is not None:  # while no group spreads, the status view says so first
            note = self.stall.state()
            self.watchdog.activity = (f"{note}; " if note else "") + what.format(url=self.client.urls[0])

    def next(self, policy_version: int) -> tuple[ScoredBatch, dict]:
        cfg = self.cfg
        groups: list[ScoredBatch] = []
        info = {"wait_s": 0.0, "gen_s": 0.0, "rejected_batches": 0, "dropped_stale": 0, "lost_batches": 0}
        gen = RolloutStats()
        if self.lockstep:
            self._next_lockstep(policy_version, groups, info, gen)
            info["own_gen"] = gen
            return collate(groups), info
        last_note = time.time()
        self.idle_since = time.time()
        while len(groups) < cfg.train_batch_groups:
            # Long-poll while the server still holds work that may be our uploads; another rank may have
            # taken them already, and a blind wait then cost a second per step. With workers, poll in slices.
            pending = self.in_flight > 0 and self._server_busy()
            wait = 1.0 if pending else (self._worker_slice() if cfg.num_gen_workers and not self.in_flight else 0.0)
            got = self._take(policy_version, info, wait)
            if got is not None:
                if got is not False:
                    groups.append(got)
                continue
            if pending and self._server_busy():
                continue  # our uploads are still queued or being scored: keep waiting for them
            self._forget_in_flight(info)
            if self._may_generate():
                self._generate(policy_version, info, gen)
            elif time.time() - last_note > 30:
                log.info("waiting for scored batches from genonly workers (%.0f s so far)", info["wait_s"])
                last_note = time.time()
        info["own_gen"] = gen
        return collate(groups), info

    def _next_lockstep(self, policy_version: int, groups: list, info: dict, gen: RolloutStats) -> None:
        """ZeRO-3: every module call gathers parameters from all ranks, so generating is a collective. Ranks go
        round by round: each takes what the server has for it; then, if any rank still lacks groups and has
        nothing coming, ALL ranks generate (synced_gpus), a rank already served uploading for the others."""
        cfg = self.cfg
        self.idle_since = time.time()
        while True:
            short = len(groups) < cfg.train_batch_groups
            idle = False
            if short:
                pending = self.in_flight > 0 and self._server_busy()
                got = self._take(policy_version, info, 1.0 if pending else
                                 min(1.0, self._worker_slice()) if cfg.num_gen_workers else 0.0)
                if got:
                    groups.append(got)
                short = len(groups) < cfg.train_batch_groups
                idle = short and got is None and not (pending and self._server_busy())
            if all_reduce_int(int(short)) == 0:  # every rank has its batch
                return
            if idle:
                self._forget_in_flight(info)
            self._doing("agreeing with the other ranks whether to generate (ZeRO-3 lockstep)")
            if all_reduce_int(int(idle and self._may_generate())):
                self._generate(policy_version, info, gen)

    def _take(self, policy_version: int, info: dict, wait: float):
        """One GET /get: a usable batch, False for one rejected or stale, None when there was none."""
        t0 = time.time()
        self._doing("waiting for a scored batch from the ref server {url} (GET /get)")
        b = self.client.get(timeout=wait)
        info["wait_s"] += time.time() - t0
        if b is None:
            return None
        try:
            check_scored(b, self.cfg, self.vocab)
        except ProtocolError as e:
            log.error("rejected scored batch: %s", e)
            info["rejected_batches"] += 1
            self.rejected_in_a_row += 1
            limit = self.cfg.max_rejected_batches
            if limit and self.rejected_in_a_row >= limit:
                raise UnusableBatches(f"{self.rejected_in_a_row} scored batches in a row rejected, none usable "
                                      f"(max_rejected_batches {limit}); the last: {e}") from e
            return False
        self.rejected_in_a_row = 0
        if b.producer_id == self.producer_id:
            self.in_flight = max(0, self.in_flight - 1)
        if is_stale(self.cfg, policy_version, b):
            # too old to learn from safely, or newer than ours: from steps lost before a resume
            info["dropped_stale"] += 1
            return False
        self.stall.progress()
        self.idle_since = time.time()
        return b

    def _forget_in_flight(self, info: dict) -> None:
        if self.in_flight and self.client.outages != self.outages_at_upload:
            # the server was unreachable since our uploads: they died with it; count them and generate anew
            log.warning("%d uploaded batch(es) lost with the ref server; generating new ones", self.in_flight)
            info["lost_batches"] += self.in_flight
        self.in_flight = 0  # nothing pending: what we uploaded went to another rank (or was lost)

    def _worker_slice(self) -> float:
        """The next long-poll for a worker's batch: 2 s slices, the last one ending when get_wait does. A whole
        2 s slice past get_wait made a rank whose workers were gone wait up to 2 s longer than asked every step
        (get_wait 3: 4 s; 0.5: 2 s). With get_wait 0 (workers only), or past it while the rank may not generate
        yet (workers still starting), whole slices: a short one would only poll the server more often."""
        left = self.cfg.get_wait - (time.time() - self.idle_since)
        return min(2.0, max(0.05, left)) if self.cfg.get_wait > 0 and left > 0 else 2.0

    def _may_generate(self) -> bool:
        cfg = self.cfg
        if cfg.num_gen_workers and self.starting.still_starting():
            return False  # a vLLM worker on our GPU is profiling its memory: our allocations would break it
        return cfg.num_gen_workers == 0 or (cfg.get_wait > 0 and time.time() - self.idle_since > cfg.get_wait)

    def _generate(self, policy_version: int, info: dict, gen: RolloutStats) -> None:
        t0 = time.time()
        self._doing("generating its own rollouts")
        batches, st = generate_batches(self.engine, self.tok, self.sampler.next_batch(self.cfg.Q_batch_size),
                                       self.cfg, self.scorer, policy_version, self.producer_id, self.toolbox,
                                       epoch=self.sampler.progress(), agents=self.agents)
        info["gen_s"] += time.time() - t0
        gen.merge(st)
        self._doing("uploading its rollouts to the ref server {url}")
        for rb in batches:
            self.client.upload(rb)
        self.in_flight += len(batches)
        self.stall.add(st, len(batches))
        self.stall.maybe_log()
        self.outages_at_upload = self.client.outages
        self.idle_since = time.time()

    def _server_busy(self) -> bool:
        """A ref server holds work not handed out yet (queued, being scored, or scored and waiting)."""
        for url in self.client.urls:
            try:
                q = self.client.health(url).get("queues", {})
            except RefServerError:
                continue  # unreachable: nothing of ours will come from it (counted as lost above)
            if q.get("input", 0) or q.get("scoring", False) or q.get("output", 0):
                return True
        return False

