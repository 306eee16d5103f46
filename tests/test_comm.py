"""Collectives on the device their process group serves (trainer/dist/comm.py).

NCCL reduces CUDA tensors only. A real gloo group initialised for the CUDA device type alone
(`backend="cuda:gloo"`) behaves exactly like NCCL towards a CPU tensor ("No backend type associated with
device type cpu"), so the failure every GPU run met at its first step is reproduced here without a GPU.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, find_free_port

from trainer.dist import comm
from trainer.loop import _is_dist_error
from trainer.objective.update import dapo_scales
from trainer.run.step_metrics import reduce_metrics


@pytest.fixture
def group(monkeypatch):
    def init(backend: str):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
        dist.init_process_group(backend=backend, rank=0, world_size=1)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_cuda_only_group_refuses_cpu_tensors_and_the_error_is_a_dist_error(group):
    group("cuda:gloo")  # serves the cuda device type only, like nccl
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu") as e:
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
    assert _is_dist_error(e.value)  # the watchdog's diagnosis path sees it as a failed collective
    assert comm.comm_device().type == "cuda"  # so our collectives copy to CUDA there


def test_cpu_group_reduces_in_place_on_cpu(group):
    group("gloo")
    assert comm.comm_device() == torch.device("cpu")
    row = reduce_metrics({"a": 2.0, "b": 3.0, "c": 5.0}, ["a"], ["b"], ["c"])
    assert row == {"a": 2.0, "b": 3.0, "c": 5.0}
    # a reward metric no rank has (a function None on every completion): absent, not 0 (TRL's nanmean)
    assert reduce_metrics({"loss": 1.0, "reward/f": 0.5}, ["loss", "reward/f", "reward/never"], [], []) == \
        {"loss": 1.0, "reward/f": 0.5}
    assert dapo_scales([torch.ones(2, 3, dtype=torch.bool)]) == [1.0]
    assert comm.all_reduce_int(7) == 7


def test_mixed_group_prefers_cpu_for_cpu_tensors(group):
    group("cpu:gloo,cuda:gloo")  # what `cpu:gloo,cuda:nccl` looks like to us
    assert comm.comm_device() == torch.device("cpu")


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter"}


def test_every_tensor_collective_goes_through_comm():
    """A tensor collective called anywhere but trainer/dist/comm.py could hand NCCL a CPU tensor again."""
    offenders = []
    for path in [p for d in ("trainer", "common", "ref_server") for p in (REPO / d).rglob("*.py")]:
        if path == REPO / "trainer" / "dist" / "comm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else node if isinstance(node, ast.keyword) else None
            if isinstance(node, ast.keyword) and isinstance(node.value, ast.Attribute):
                f = node.value  # passed as a callback, e.g. all_reduce=torch.distributed.all_reduce
            if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and ast.unparse(f.value) in (
                    "dist", "torch.distributed", "deepspeed.comm"):
                offenders.append(f"{Path(path).relative_to(REPO)}:{node.lineno} {ast.unparse(f)}")
    assert offenders == []
