"""Roles from a Slurm allocation (trainer/dist/slurm_plan.py) and the stop request (trainer/run/requeue.py), in
process; tests/test_slurm.py runs them on a real Slurm."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

from trainer.dist.slurm_plan import AllocationError, assign, step_gpus
from trainer.run.requeue import StopRequest, agreed, request_stop

NODES = [f"gpu{i:02d}" for i in range(5)]
ADDRS = [f"10.0.0.{i + 10}" for i in range(5)]
JOB = {"SLURM_JOB_ID": "123456"}


def test_ref_server_shares_node_0_by_default():
    plan = assign(NODES[:2], ADDRS[:2], JOB, Path("/shared/run"), worker_nodes=1)
    assert plan.roles(0) == ["ref-server", "trainer-host"] and plan.roles(1) == ["workers"]
    assert plan.master_addr == "10.0.0.10" and plan.ref_url == f"http://10.0.0.10:{30000 + 123456 % 2700}"
    assert plan.master_port == 20000 + 123456 % 10000 and plan.total_workers == 1
    assert plan.node_dir(0) == Path("/shared/run") and plan.node_dir(1) == Path("/shared/run/node1")


def test_ref_nodes_and_worker_nodes():
    plan = assign(NODES, ADDRS, JOB, Path("/r"), ref_nodes=1, worker_nodes=2, workers_per_node=3)
    assert [plan.roles(k) for k in range(5)] == [["ref-server"], ["trainer-host"], ["trainer-host"], ["workers"],
                                                 ["workers"]]
    assert plan.master_addr == "10.0.0.11"  # trainer host 0, not the ref server's node
    assert plan.node_dir(1) == Path("/r") and plan.node_dir(0) == Path("/r/node0")  # trainer host 0 writes RUN_DIR
    assert (plan.first_worker_id(3), plan.first_worker_id(4), plan.total_workers) == (0, 3, 6)
    lines = plan.lines()
    assert lines[2].startswith("node 2 gpu02 (10.0.0.12): trainer-host 1/2") and "workers 3..5" in lines[4]
    two = assign(NODES[:3], ADDRS[:3], JOB, Path("/r"), ref_nodes=2)
    assert two.ref_url == ",".join(f"http://10.0.0.{i}:{two.ref_port}" for i in (10, 11))


@pytest.mark.parametrize("kw", [dict(ref_nodes=1, worker_nodes=1), dict(worker_nodes=2), dict(ref_nodes=-1)])
def test_an_allocation_that_leaves_no_trainer_host_is_one_line(kw):
    with pytest.raises(AllocationError):
        assign(NODES[:2], ADDRS[:2], JOB, Path("/r"), **kw)


def test_step_gpus():
    assert step_gpus({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert step_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert step_gpus({}) is None and step_gpus({"SLURM_GPUS_ON_NODE": "0"}) is None


def test_stop_request_and_agreement(tmp_path):
    stop = StopRequest(tmp_path)
    assert not stop.asked
    request_stop(tmp_path)
    assert stop.asked
    assert agreed([([1, 2], False), ([3], True)]) == ([[1, 2], [3]], True)
    assert agreed([([1], False), ([], False)]) == ([[1], []], False)


def test_launch_slurm_outside_an_allocation_is_one_line(tmp_path):
    env = subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    env.pop("SLURM_JOB_NODELIST", None)
    r = subprocess.run(["bash", str(REPO / "launch.sh"), "slurm", "--run-dir", "run", "--print-plan"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "[slurm] SLURM_JOB_NODELIST is not set: run this inside an allocation (sbatch/srun), or give --nodelist to "
        "print a plan"], r.stderr


def test_launch_slurm_help():
    env = subprocess_env(GRPO_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    r = subprocess.run(["bash", str(REPO / "launch.sh"), "slurm", "--help"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--worker-nodes" in r.stdout and "job id % 10000" in r.stdout, r.stderr[-2000:]
