"""Generate-only worker: sample groups with the current policy, reward them, upload them to the ref
server, and follow the policy weights rank 0 publishes (between rounds).

A worker that shares a GPU with trainer ranks (launch.sh's plan passes --wait_for_ranks N) builds its engine
only once N ranks are ready, i.e. have sent their first heartbeat to the ref server (trainer/loop.py starts it
after the engine is built and the first weights are published): vLLM's memory profiling must not overlap a rank
initialising on the same GPU (docs/gpus.md)."""
from __future__ import annotations

import json
import logging
import signal
import time
from urllib.parse import urlparse

import torch

from common.config import GRPOConfig
from common.modeling import load_tokenizer, resolve_model_path
from common.settings.gen_defaults import resolve_at_start
from common.weights.sync import WeightSync
from common.wire.client import RefServerError
from trainer import resume
from trainer.agents.rollout import AgentRollouts
from trainer.data import run_data
from trainer.data.loading import PromptSampler
from trainer.dist.nodes import host_label
from trainer.engines import EngineDied, make_engine
from trainer.lora.sync import policy_loader
from trainer.rewards.scoring import RewardScorer
from trainer.rollout import generate_batches
from trainer.run.health import Heartbeat
from trainer.run.stall import NothingToTrain, StallReporter
from trainer.run.start_order import started_workers
from trainer.runtime import make_client, setup_logging
from trainer.tools import ToolBox
from trainer.tools.multi_turn import add_tool_totals

log = logging.getLogger("trainer")


def genonly(cfg: GRPOConfig) -> None:
    """Generate-only worker: produce and upload rollouts until stopped (SIGTERM/SIGINT end it cleanly)."""
    setup_logging(f"worker{cfg.worker_id}")
    cfg = resolve_at_start(cfg, log, f"worker{cfg.worker_id}", producer="worker")  # its first lines say them
    stop = {"now": False}

    def on_signal(signum, _frame):
        log.info("signal %d: finishing this round, then exiting", signum)
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    torch.manual_seed(cfg.seed + 1000 + cfg.worker_id)
    model_path = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_path, cfg.load_options())
    ref_host = urlparse(cfg.ref_server.split(",")[0]).hostname  # named by the address that reaches the server
    client = make_client(cfg, f"worker{cfg.worker_id}", "worker", host=host_label(ref_host))
    client.give_up = lambda: stop["now"]  # stopping: no backoff against a server launch.sh stopped with us
    client.wait_ready(timeout=300)
    examples = run_data.train_examples(cfg)
    sampler = PromptSampler(examples, seed=cfg.seed + 1000 + cfg.worker_id)
    state_path = resume.worker_state_path(cfg.output_dir, cfg.worker_id)
    if cfg.resume and state_path.is_file():  # continue this worker's data order where it stopped
        resume.restore(sampler, json.loads(state_path.read_text()))
        log.info("data order resumed from %s: epoch %d", state_path, sampler.epoch)
    scorer = RewardScorer.from_config(cfg)
    toolbox = ToolBox.from_config(cfg, tok)  # None without tools; this worker's own tool process, closed at the end
    if cfg.wait_for_ranks:
        wait_for_ranks(client, cfg)
    if cfg.start_after:  # earlier vLLM workers on this GPU: one profiling at a time
        wait_for_workers(client, cfg)
    engine = make_engine(cfg, model_path, tokenizer=tok)  # after wait_ready: the server may still be loading
    log.info("generation engine: %s, eos ids %s", cfg.gen_backend, engine.eos_ids)
    agents = AgentRollouts.from_config(cfg, engine, tok)  # None without `agent`: its endpoint on this engine
    syncer = (WeightSync(client=None if cfg.sync_dir else client, sync_dir=cfg.sync_dir, delta=cfg.sync_delta)
              if cfg.sync_steps else None)
    # LoRA runs publish adapters only (merged into W0 here); a delta brings only the tensors that changed
    load_policy = policy_loader(engine, model_path, held=lambda: syncer.held,
                                revision=cfg.load_options().get("revision"))

    rounds = uploaded = skipped = timeouts = gen_tokens = agent_faults = 0
    tool_totals: dict = {}  # cumulative tool counters for the /status view (tool runs)
    gen_s = 0.0
    stall = StallReporter.from_config(f"worker{cfg.worker_id}", cfg)  # NothingToTrain: exit 7 (trainer/main.py)
    doing = {"now": "starting"}
    heartbeat = Heartbeat(client, cfg.heartbeat_s, lambda: doing["now"],
                          lambda: {"rounds": rounds, "skipped_groups": skipped, **tool_totals,
                                   **({"agent_faults": agent_faults} if agents is not None else {})}).start()
    epochs_run_length(client, cfg, doing)  # num_train_epochs: the ranks' step count, for trainer_state.max_steps
    t_start = time.time()
    while not stop["now"] and (cfg.worker_rounds == 0 or rounds < cfg.worker_rounds):
        try:
            health = client.health(retry=True)  # an outage: backoff, logged once by the client
            q = health.get("queues", {})
            if q.get("input", 0) + q.get("output", 0) >= cfg.worker_max_queued:
                doing["now"] = "paused: the server holds enough batches"
                if syncer is not None and syncer.is_newer(health.get("policy_version")):
                    # follow the policy while paused, each version as it comes: the next round starts on the
                    # newest weights, and a worker waiting out two publishes fetched the full copy, not a delta
                    syncer.follow(apply=load_policy, retries=cfg.weight_fetch_retries)
                time.sleep(0.2)  # the trainer has enough to chew on; generate later, with newer weights
                continue
            if syncer is not None:  # between rounds: swap in newer policy weights, if any
                doing["now"] = "checking for new policy weights"
                syncer.follow(apply=load_policy, retries=cfg.weight_fetch_retries)
            version = syncer.version if syncer is not None and syncer.version is not None else 0
            client.set_version(version)
            note = stall.state()  # "nothing to train: N groups in a row without reward spread" (launch.sh status)
            doing["now"] = (f"{note}; " if note else "") + f"generating round {rounds + 1}"
            batches, st = generate_batches(engine, tok, sampler.next_batch(cfg.Q_batch_size), cfg, scorer,
                                           policy_version=version, producer_id=f"worker{cfg.worker_id}",
                                           toolbox=toolbox, epoch=sampler.progress(), agents=agents)
            for rb in batches:
                if stop["now"]:
                    break
                client.upload(rb)
                uploaded += 1
        except EngineDied as e:  # nothing to retry: say why and exit non-zero (the trainer carries on)
            log.error("generation engine died, worker exits: %s", e)
            raise SystemExit(3) from e
        except RefServerError as e:  # the client already retried with backoff; keep going, say so
            if stop["now"]:  # asked to stop: the server went with the run (the client did not retry)
                break
            log.warning("ref server problem, retrying next round: %s", e)
            time.sleep(1.0)
            continue
        rounds += 1
        skipped += st.skipped_no_spread
        try:
            stall.add(st, len(batches))
        except NothingToTrain:  # its last word in /status: why it stopped (launch.sh status), not "generating"
            heartbeat.stop(stall.state() or "nothing to train")
            raise
        stall.maybe_log()
        timeouts += st.reward_timeouts
        agent_faults += st.agent_faults  # rollouts with no reward: their agent failed (in /status)
        add_tool_totals(tool_totals, st.tools)
        gen_tokens, gen_s = gen_tokens + st.completion_tokens, gen_s + st.seconds
        resume.write_json(state_path, resume.capture(sampler))
        if rounds % 10 == 0:
            log.info("round %d: %d batches uploaded, %d groups skipped (no spread) so far; %.1f completions/s this "
                     "round; generated %d tokens in %.1f s", rounds, uploaded, skipped,
                     st.completions / max(st.seconds, 1e-9), gen_tokens, gen_s)  # the totals, also if killed later
    scorer.close()
    if toolbox is not None:
        toolbox.close()
    if agents is not None:
        agents.close()
    heartbeat.stop("done")
    log.info("worker done: %d rounds, %d batches uploaded in %.0f s, %d reward_timeouts; generated %d tokens in "
             "%.1f s: %.1f tokens/s", rounds, uploaded, time.time() - t_start, timeouts, gen_tokens, gen_s,
             gen_tokens / max(gen_s, 1e-9))


def epochs_run_length(client, cfg: GRPOConfig, doing: dict, poll: float = 0.5) -> None:
    """With num_train_epochs, all_steps comes from the training set's size AND the ranks' world size, which only
    the ranks know (trainer/loop.py resolve_epochs): wait until a rank reports it in its heartbeat, so the rewards'
    trainer_state.max_steps is the run's, not the unresolved default. Past wait_for_ranks_timeout: exit 3."""
    if cfg.num_train_epochs is None:
        return
    doing["now"] = "waiting for the ranks' step count (num_train_epochs)"
    t0 = time.monotonic()
    while time.monotonic() - t0 <= cfg.wait_for_ranks_timeout:
        try:
            steps = [r.get("all_steps") or 0 for r in client.status(timeout=10).get("participants", [])
                     if r.get("role") == "rank" and r.get("state") != "done"]
        except RefServerError:  # the server answered /health already: a hiccup, keep asking
            steps = []
        if any(steps):
            cfg.all_steps = max(steps)
            log.info("num_train_epochs %s: all_steps %d, as the ranks count it", cfg.num_train_epochs, cfg.all_steps)
            return
        time.sleep(poll)
    log.error("worker%d: no trainer rank reported its step count (num_train_epochs) within %.0f s "
              "(wait_for_ranks_timeout)", cfg.worker_id, cfg.wait_for_ranks_timeout)
    raise SystemExit(3)


def ready_ranks(status: dict, fresh_s: float) -> list[str]:
    """The trainer ranks that are up: they have sent a heartbeat (the first comes once a rank's engine is built),
    recently (a crashed earlier attempt's rows on a long-lived server do not count), and are not done."""
    return sorted(r["id"] for r in status.get("participants", []) if r.get("role") == "rank"
                  and r.get("last_heartbeat_ago_s") is not None and r["last_heartbeat_ago_s"] <= fresh_s
                  and r.get("state") != "done")


def wait_for_ranks(client, cfg: GRPOConfig, poll: float = 0.5) -> None:
    """Block until cfg.wait_for_ranks ranks are ready at the ref server (GET /status); past
    cfg.wait_for_ranks_timeout, exit non-zero naming what is missing."""
    n, t0 = cfg.wait_for_ranks, time.monotonic()
    log.info("waiting for %d trainer rank(s) to be ready before this worker builds its engine, as it shares a GPU "
             "with them (wait_for_ranks; at most %.0f s)", n, cfg.wait_for_ranks_timeout)
    last, beat_at = "no answer from GET /status yet", 0.0
    while True:
        try:
            if time.monotonic() >= beat_at:  # in the status table meanwhile, not stalled
                client.heartbeat(f"waiting for {n} trainer rank(s) to be ready (shares their GPU)")
                beat_at = time.monotonic() + cfg.heartbeat_s
            ready = ready_ranks(client.status(timeout=10), fresh_s=2 * cfg.heartbeat_s + 5)
            if len(ready) >= n:
                log.info("trainer rank(s) ready after %.1f s (%s): building the engine now",
                         time.monotonic() - t0, ", ".join(ready))
                return
            last = f"ready so far: {', '.join(ready) or 'none'}"
        except RefServerError as e:  # the server answered /health already: a hiccup, keep asking
            last = f"GET /status failed: {e}"
        if time.monotonic() - t0 > cfg.wait_for_ranks_timeout:
            log.error("worker%d: %d trainer rank(s) not ready after %.0f s (%s); this worker shares a GPU with them "
                      "and builds its engine only once they are (wait_for_ranks_timeout, docs/gpus.md)", cfg.worker_id,
                      n, cfg.wait_for_ranks_timeout, last)
            raise SystemExit(1)
        time.sleep(poll)


def wait_for_workers(client, cfg: GRPOConfig, poll: float = 0.5) -> None:
    """Block until the workers in cfg.start_after have their engines up (trainer/run/start_order.py); past
    cfg.wait_for_ranks_timeout, exit non-zero naming the missing ones."""
    names, t0, beat_at = sorted(cfg.start_after), time.monotonic(), 0.0
    log.info("waiting for %s to start before this worker builds its engine: they share its GPU and vLLM profiles "
             "one process at a time (start_after; at most %.0f s)", ", ".join(names), cfg.wait_for_ranks_timeout)
    missing = names
    while True:
        try:
            if time.monotonic() >= beat_at:
                client.heartbeat(f"waiting for {', '.join(names)} to start (shares their GPU)")
                beat_at = time.monotonic() + cfg.heartbeat_s
            up = started_workers(client.status(timeout=10), fresh_s=2 * cfg.heartbeat_s + 5)
            missing = [n for n in names if n not in up]
            if not missing:
                log.info("%s up after %.1f s: building the engine now", ", ".join(names), time.monotonic() - t0)
                return
        except RefServerError as e:  # the server answered /health already: a hiccup, keep asking
            log.info("GET /status failed while waiting for workers: %s", e)
        if time.monotonic() - t0 > cfg.wait_for_ranks_timeout:
            log.error("worker%d: %s not up after %.0f s; this worker shares a GPU with them and builds its engine only "
                      "once they are (start_after, wait_for_ranks_timeout, docs/gpus.md)", cfg.worker_id,
                      ", ".join(missing), cfg.wait_for_ranks_timeout)
            raise SystemExit(1)
        time.sleep(poll)
