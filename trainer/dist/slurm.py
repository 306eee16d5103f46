"""`launch.sh slurm`: one task per node of a Slurm allocation (issue 63), run by examples/slurm/train.sbatch as
`srun --ntasks-per-node=1 ./launch.sh slurm --run-dir R [--ref-nodes N] [--worker-nodes N] [-- trainer args]`.

Each task reads the allocation (trainer/dist/slurm_plan.py), takes its node's roles and starts them as the
documented per-host commands (`launch.sh ref-server | trainer-host | workers`, trainer/dist/hosts.py) with the
rendezvous address and port and the ref URL filled in, each logging to its node's run directory (RUN_DIR on trainer
host 0's node, RUN_DIR/node<k> elsewhere; RUN_DIR must be on storage every node and the login node share: checked
at start). The bearer token comes from the environment (GRPO_REF_TOKEN, which train.sbatch generates; never on a
command line). A run directory that holds a checkpoint is resumed from it (--resume true on every trainer host).

Signals: SIGUSR1 (Slurm's time-limit warning, forwarded by train.sbatch) asks the ranks for a checkpoint at the end
of their step and exit 75 (trainer/run/requeue.py); every process started here keeps SIGUSR1 ignored. The node of
trainer host 0 records how the run ended (RUN_DIR/run_end.json, read by `launch.sh status --run-dir R` from the
login node, and RUN_DIR/slurm_job.json); the other nodes stop their processes once it has. SIGTERM (scancel,
preemption) stops every process here at once: the last completed checkpoint stands.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.run_record import write_end, write_start
from common.settings.argparser import ArgumentParser
from trainer.dist.hosts import ROOT, caller_path, split_extra, trainer_args
from trainer.dist.slurm_plan import AllocationError, Plan, make_plan, shared_marker, this_node
from trainer.run.requeue import EXIT_REQUEUE, STOP_FILE, request_stop

SHARED_WAIT_S = 60  # how long a node looks for node 0's marker (a network filesystem's attribute cache)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_extra(argv)
    p = ArgumentParser(prog="launch.sh slurm", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the run directory, on storage every node and the login "
                                                     "node share")
    p.add_argument("--config", help="trainer config JSON")
    p.add_argument("--ref-nodes", type=int, default=0, help="nodes of the ref server's own (default 0: it shares "
                                                             "node 0 with trainer host 0)")
    p.add_argument("--worker-nodes", type=int, default=0, help="the last N nodes run genonly workers")
    p.add_argument("--workers-per-node", type=int, default=1, help="genonly workers on each worker node")
    p.add_argument("--gpus", type=int, help="ranks per trainer host (default: the GPUs Slurm gave the step, else 1)")
    p.add_argument("--ref-model", help="the ref server's model (default: the trainer's ref_model, else model)")
    p.add_argument("--ref-device", default="auto")
    p.add_argument("--ref-dtype", default="auto")
    p.add_argument("--master-port", type=int, help="rendezvous port (default 20000 + job id %% 10000)")
    p.add_argument("--port", type=int, help="ref server port (default 30000 + job id %% 2700)")
    p.add_argument("--nodelist", help="a node list in place of SLURM_JOB_NODELIST (to print a plan elsewhere)")
    p.add_argument("--print-plan", action="store_true", help="print each node's roles and exit without starting "
                                                             "anything")
    return p.parse_args(argv), trainer_args(extra)


def ref_model(args: argparse.Namespace, extra: list[str]) -> str:
    from common.config import GRPOConfig
    from common.settings.knobs import load_config

    if args.ref_model:
        return args.ref_model
    cfg = load_config(GRPOConfig, [*(["--config", caller_path(args.config)] if args.config else []), *extra])
    return cfg.ref_model or cfg.model


class Node:
    """This node's processes: start them, forward the stop request, end with the run."""

    def __init__(self, plan: Plan, k: int, args: argparse.Namespace, extra: list[str]) -> None:
        self.plan, self.k, self.args, self.extra = plan, k, args, extra
        self.dir = plan.node_dir(k)
        self.leader = k == plan.trainers[0]  # trainer host 0: records the run's start and end
        self.procs: dict[str, subprocess.Popen] = {}
        self.marker, self.attempt = shared_marker(plan, os.environ)

    def say(self, msg: str) -> None:
        print(f"[slurm] node {self.k} ({self.plan.nodes[self.k]}): {msg}", file=sys.stderr, flush=True)

    def start(self, name: str, role: str, *argv: str) -> None:
        cmd = [sys.executable, "-m", "trainer.dist.hosts", role, *argv]
        with open(self.dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=_ignore_usr1)
        self.say(f"{name} (pid {self.procs[name].pid}) -> {self.dir / name}.log")

    def check_shared(self) -> None:
        """Node 0's marker seen from here; the folder sbatch ran in (the login node's) seen from here."""
        submit = os.environ.get("SLURM_SUBMIT_DIR")
        if submit and not Path(submit).is_dir():
            raise AllocationError(f"the folder sbatch was run in ({submit}) is not on this node: the checkout and "
                                  f"the run directory must be on storage the login node and every node share")
        if self.leader:
            _write_json(self.marker, {"attempt": self.attempt, "nodes": self.plan.nodes})
            return
        end = time.monotonic() + SHARED_WAIT_S
        while time.monotonic() < end:
            if self.marker_state().get("attempt") == self.attempt:
                return
            time.sleep(0.5)
        raise AllocationError(f"{self.marker} (written by trainer host 0's node for job {self.attempt}) is not "
                              f"seen here after {SHARED_WAIT_S} s: --run-dir {self.plan.run_dir} must be on "
                              f"storage every node and the login node share (not a node's /tmp)")

    def marker_state(self) -> dict:
        try:
            return json.loads(self.marker.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def run(self) -> int:
        plan, a = self.plan, self.args
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / STOP_FILE).unlink(missing_ok=True)  # an earlier attempt's request
        self.check_shared()
        if self.leader:
            (plan.run_dir / "diagnosis.txt").unlink(missing_ok=True)
            write_start(plan.run_dir, plan.ref_url.split(",")[0])  # `launch.sh status --run-dir` asks it
        cfg = ["--config", caller_path(a.config)] if a.config else []
        if self.k in plan.ref:
            self.start("ref_server", "ref-server", "--host", plan.addrs[self.k], "--port", str(plan.ref_port),
                       "--ref-model", ref_model(a, self.extra), "--ref-device", a.ref_device,
                       "--ref-dtype", a.ref_dtype)
        if self.k in plan.trainers:
            resume = (plan.node_dir(plan.trainers[0]) / "ds" / "latest").is_file()
            if resume:
                self.say("the run directory holds a checkpoint: resuming from it (--resume true)")
            gpus = a.gpus or plan.gpus
            self.start("trainer", "trainer-host", "--nodes", str(len(plan.trainers)),
                       "--node-rank", str(plan.trainers.index(self.k)), "--master-addr", plan.master_addr,
                       "--master-port", str(plan.master_port), *(["--gpus", str(gpus)] if gpus else []),
                       "--ref-url", plan.ref_url, "--workers", str(plan.total_workers), "--run-dir", str(self.dir),
                       *cfg, "--", *self.extra, *(["--resume", "true"] if resume else []))
        if self.k in plan.workers:
            self.start("workers", "workers", "--ref-url", plan.ref_url, "--run-dir", str(self.dir),
                       "--workers", str(plan.workers_per_node), "--first-id", str(plan.first_worker_id(self.k)),
                       *cfg, "--", *self.extra)
        signal.signal(signal.SIGUSR1, self.on_usr1)
        return self.watch()

    def on_usr1(self, _signum, _frame) -> None:
        if "trainer" in self.procs:
            request_stop(self.dir)
            self.say(f"SIGUSR1: the ranks stop after this step with a checkpoint (exit {EXIT_REQUEUE})")
        else:
            self.say("SIGUSR1: this node stops when the trainer has saved its checkpoint")

    def watch(self) -> int:
        trainer = self.procs.get("trainer")
        while True:
            if trainer is not None and trainer.poll() is not None:
                code = trainer.returncode
                self.say(f"the trainer exited with code {code}")
                self.stop()
                self.ended(code)
                return code
            state = self.marker_state()
            if trainer is None and state.get("attempt") == self.attempt and "exit_code" in state:
                self.say(f"the run ended (exit {state['exit_code']}): stopping this node")
                self.stop()
                return 0
            ref = self.procs.get("ref_server")
            if ref is not None and ref.poll() is not None:  # the ranks would wait for it until stall_timeout
                self.say(f"the ref server exited with code {ref.returncode} (see {self.dir}/ref_server.log)")
                self.stop()
                return 3
            time.sleep(0.5)

    def ended(self, code: int) -> None:
        """Trainer host 0's node: how the run ended, for `launch.sh status` and for the other nodes."""
        if self.leader:
            write_end(self.plan.run_dir, code)  # also drops a checkpoint the stop left half-written
            _write_json(self.marker, {**self.marker_state(), "exit_code": code})

    def stop(self, grace: float = 20.0) -> None:
        """TERM every group started here (a second one to the ref server skips its drain), KILL after `grace`."""
        for _ in range(2):
            for p in self.procs.values():
                _signal_group(p, signal.SIGTERM)
            time.sleep(0.2)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.2)
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _ignore_usr1() -> None:
    """Children keep SIGUSR1 ignored (inherited across exec): a signal Slurm sends the whole step ends none."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    run_dir = Path(caller_path(args.run_dir)).resolve()
    try:
        plan = make_plan(dict(os.environ), run_dir, args.ref_nodes, args.worker_nodes, args.workers_per_node,
                         args.master_port, args.port, args.nodelist)
        if args.print_plan:
            print("\n".join(plan.lines()))
            return 0
        k = this_node(dict(os.environ), plan)
        if not os.environ.get("GRPO_REF_TOKEN"):
            raise AllocationError("GRPO_REF_TOKEN is not set: the batch script generates it and srun passes it on "
                                  "(examples/slurm/train.sbatch)")
        node = Node(plan, k, args, extra)
        node.say("; ".join(plan.lines()[k:k + 1] + plan.lines()[-1:]))

        def on_term(signum, _frame) -> None:  # scancel, preemption: KILL follows after KillWait
            node.say(f"signal {signum}: stopping this node's processes")
            node.stop(grace=5.0)
            node.ended(128 + signum)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        return node.run()
    except AllocationError as e:
        print(f"[slurm] {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
