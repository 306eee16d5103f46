"""Which node of a Slurm allocation does what (issue 63): what `launch.sh slurm` reads and `--print-plan` prints.

The allocation: SLURM_JOB_NODELIST expanded by `scontrol show hostnames`, each node's address (`scontrol show node`:
its NodeAddr, the address Slurm itself reaches it at), SLURM_NODEID (this node), SLURM_JOB_ID and the GPUs Slurm gave
the step on this node (SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES it set). Roles, by position in the node list:

    --ref-nodes 0 (default)   node 0: the ref server and trainer host 0 (the ref server on the GPU the ranks leave)
    --ref-nodes R             nodes 0..R-1: one ref server each (the ranks use them all), nothing else
    trainer hosts             the nodes after those, up to the worker nodes; trainer host 0 is the rendezvous
    --worker-nodes W          the last W nodes: genonly workers

Ports come from the job id (two jobs sharing a node do not collide; below the ephemeral range): the rendezvous
20000 + id % 10000, the ref server 30000 + id % 2700.
"""
from __future__ import annotations

import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


class AllocationError(ValueError):
    """The allocation cannot run the asked roles, or is not there: one line saying why."""


@dataclass
class Plan:
    nodes: list[str]
    addrs: list[str]
    ref: list[int]  # node indices with a ref server
    trainers: list[int]  # node indices with a trainer host, in node-rank order
    workers: list[int]  # node indices with genonly workers
    workers_per_node: int
    master_port: int
    ref_port: int
    run_dir: Path
    job_id: str
    gpus: int | None = None  # GPUs Slurm gave this node's step (None: not said)
    extra: dict = field(default_factory=dict)

    @property
    def master_addr(self) -> str:
        return self.addrs[self.trainers[0]]

    @property
    def ref_url(self) -> str:
        return ",".join(f"http://{self.addrs[i]}:{self.ref_port}" for i in self.ref)

    @property
    def total_workers(self) -> int:
        return len(self.workers) * self.workers_per_node

    def roles(self, k: int) -> list[str]:
        out = ["ref-server"] if k in self.ref else []
        out += ["trainer-host"] if k in self.trainers else []
        return out + (["workers"] if k in self.workers else [])

    def node_dir(self, k: int) -> Path:
        """Trainer host 0's node writes RUN_DIR itself (rank 0's checkpoints, metrics, logs); every other node
        RUN_DIR/node<k>: each trainer host its own ranks' shards, each worker node its workers' state and logs."""
        return self.run_dir if k == self.trainers[0] else self.run_dir / f"node{k}"

    def first_worker_id(self, k: int) -> int:
        return self.workers.index(k) * self.workers_per_node

    def lines(self) -> list[str]:
        out = []
        for k, name in enumerate(self.nodes):
            what = []
            for role in self.roles(k):
                if role == "ref-server":
                    what.append(f"ref-server :{self.ref_port}")
                elif role == "trainer-host":
                    what.append(f"trainer-host {self.trainers.index(k)}/{len(self.trainers)} "
                                f"({self.gpus or 'default'} ranks)")
                else:
                    first = self.first_worker_id(k)
                    what.append(f"workers {first}..{first + self.workers_per_node - 1}")
            out.append(f"node {k} {name} ({self.addrs[k]}): {' + '.join(what)}; run dir {self.node_dir(k)}")
        out.append(f"rendezvous {self.master_addr}:{self.master_port}; ref URL {self.ref_url}; "
                   f"{self.total_workers} worker(s) in all; job {self.job_id}")
        return out


def hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: n[0-3],x -> n0 n1 n2 n3 x."""
    try:
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise AllocationError("no `scontrol` on PATH: launch.sh slurm runs inside a Slurm allocation") from e
    if r.returncode != 0 or not r.stdout.split():
        raise AllocationError(f"scontrol show hostnames {nodelist!r} failed: {r.stderr.strip()[:300]}")
    return r.stdout.split()


def node_addr(name: str) -> str:
    """The address Slurm reaches `name` at (its NodeAddr), as an IP address where it resolves."""
    r = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=60)
    m = re.search(r"\bNodeAddr=(\S+)", r.stdout) if r.returncode == 0 else None
    addr = m.group(1) if m else name
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr  # a name the nodes resolve and this host does not: kept as it is


def step_gpus(env: dict) -> int | None:
    """GPUs Slurm gave this step on this node (None when it gave none, or did not say)."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"]) or None
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible and visible != "NoDevFiles" else None


def make_plan(env: dict, run_dir: Path, ref_nodes: int = 0, worker_nodes: int = 0, workers_per_node: int = 1,
              master_port: int | None = None, ref_port: int | None = None, nodelist: str | None = None) -> Plan:
    nodelist = nodelist or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise AllocationError("SLURM_JOB_NODELIST is not set: run this inside an allocation (sbatch/srun), or give "
                              "--nodelist to print a plan")
    nodes = hostnames(nodelist)
    return assign(nodes, [node_addr(n) for n in nodes], env, run_dir, ref_nodes, worker_nodes, workers_per_node,
                  master_port, ref_port)


def assign(nodes: list[str], addrs: list[str], env: dict, run_dir: Path, ref_nodes: int = 0, worker_nodes: int = 0,
           workers_per_node: int = 1, master_port: int | None = None, ref_port: int | None = None) -> Plan:
    """The roles of `nodes` (at `addrs`), by position."""
    if ref_nodes < 0 or worker_nodes < 0 or workers_per_node < 1:
        raise AllocationError("--ref-nodes and --worker-nodes are 0 or more, --workers-per-node 1 or more")
    trainers = list(range(ref_nodes, len(nodes) - worker_nodes))
    if not trainers:
        raise AllocationError(f"{len(nodes)} node(s) leave no trainer host after --ref-nodes {ref_nodes} and "
                              f"--worker-nodes {worker_nodes}")
    job = env.get("SLURM_JOB_ID", "0")
    jid = int(job) if job.isdigit() else 0
    return Plan(nodes=nodes, addrs=addrs, ref=list(range(ref_nodes)) or [0],
                trainers=trainers, workers=list(range(len(nodes) - worker_nodes, len(nodes))),
                workers_per_node=workers_per_node, master_port=master_port or 20000 + jid % 10000,
                ref_port=ref_port or 30000 + jid % 2700, run_dir=run_dir, job_id=job, gpus=step_gpus(env))


def this_node(env: dict, plan: Plan) -> int:
    k = env.get("SLURM_NODEID", "")
    if not k.isdigit() or int(k) >= len(plan.nodes):
        raise AllocationError(f"SLURM_NODEID is {k or 'not set'}: launch.sh slurm runs once per node under srun "
                              f"(srun --ntasks-per-node=1 ... launch.sh slurm)")
    return int(k)


def shared_marker(plan: Plan, env: dict) -> tuple[Path, str]:
    """The file node 0 writes and every node must see: the run directory is on shared storage."""
    attempt = f"{plan.job_id}.{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    return plan.run_dir / "slurm_job.json", attempt

