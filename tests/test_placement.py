"""The placement plan (common/placement/plan.py) for 0, 1, 2, 4 and 8 GPUs, the launcher's flags, worker hosts and
workers spanning GPUs. launch.sh's side (--print-plan with a fake nvidia-smi, /status):
tests/test_placement_launch.py."""
from __future__ import annotations

import os

import pytest

from common.placement.plan import describe, plan_placement
from trainer.engines.vllm import visible_devices_for


def where(plan) -> dict:
    """process name -> its GPUs, plus the ranks' deepspeed arguments."""
    out = {p.name: list(p.gpus) for p in plan.processes}
    out["ds"] = " ".join(plan.deepspeed_args)
    return out


def assert_no_gpu_shared(plan):
    used = [g for p in plan.processes for g in p.gpus]
    assert len(used) == len(set(used)), where(plan)
    assert all(p.vllm_gpu_memory_utilization is None for p in plan.workers)


def test_no_gpu_is_the_cpu_plan():
    plan = plan_placement([], workers=2)
    assert plan.mode == "cpu" and plan.deepspeed_args == ["--num_gpus", "2"]
    assert all(p.gpus == () and p.cuda_visible_devices is None for p in plan.processes)  # today's behaviour
    assert plan_placement([], workers=0, ranks=3).deepspeed_args == ["--num_gpus", "3"]
    for bad in (dict(ref_device="cuda:0"), dict(worker_gpus=[0]), dict(rank_gpus=[0])):
        with pytest.raises(ValueError, match="no GPU"):
            plan_placement([], workers=1, **bad)


def test_one_gpu_is_shared_and_says_so():
    plan = plan_placement([0], workers=1)
    assert plan.mode == "shared" and where(plan) == {"ref_server": [0], "worker0": [0], "ranks": [0],
                                                     "ds": "--include localhost:0"}
    assert plan.workers[0].vllm_gpu_memory_utilization == 0.3  # TRL's colocate default: room for the others
    assert "only 1 GPU" in describe(plan.to_json()) and "SHARED" in describe(plan.to_json())
    two = plan_placement([0], workers=2)
    assert [w.vllm_gpu_memory_utilization for w in two.workers] == [0.15, 0.15]
    assert plan_placement([0], workers=1, vllm_workers=False).workers[0].vllm_gpu_memory_utilization is None
    assert plan_placement([0], workers=1, vllm_fraction=0.4).workers[0].vllm_gpu_memory_utilization == 0.4
    with pytest.raises(ValueError, match="exceeds"):
        plan_placement([0], workers=2, vllm_fraction=0.5)


def test_two_gpus_need_sharing_or_fewer_processes():
    with pytest.raises(ValueError, match="needs 3 GPUs.*--share-gpu"):
        plan_placement([0, 1], workers=1)
    plan = plan_placement([0, 1], workers=1, ref_device="cpu")
    assert where(plan) == {"ref_server": [], "worker0": [1], "ranks": [0], "ds": "--include localhost:0"}
    assert plan.ref.cuda_visible_devices == "" and plan.ref.device == "cpu"  # hidden from the GPUs
    assert_no_gpu_shared(plan)
    assert where(plan_placement([0, 1], workers=0)) == {"ref_server": [1], "ranks": [0],
                                                         "ds": "--include localhost:0"}
    shared = plan_placement([0, 1], workers=1, share=True)
    assert where(shared) == {"ref_server": [1], "worker0": [0], "ranks": [0, 1], "ds": "--include localhost:0,1"}
    assert shared.workers[0].shares_gpu_with == ("ranks",)


@pytest.mark.parametrize("n,workers,want", [
    (4, 1, {"ref_server": [3], "worker0": [2], "ranks": [0, 1]}),
    (4, 2, {"ref_server": [3], "worker0": [2], "worker1": [1], "ranks": [0]}),
    (8, 1, {"ref_server": [7], "worker0": [6], "ranks": [0, 1, 2, 3, 4, 5]}),
    (8, 3, {"ref_server": [7], "worker0": [6], "worker1": [5], "worker2": [4], "ranks": [0, 1, 2, 3]}),
])
def test_own_gpu_per_process(n, workers, want):
    plan = plan_placement(range(n), workers=workers)
    assert plan.mode == "own" and {k: v for k, v in where(plan).items() if k != "ds"} == want
    assert plan.deepspeed_args == ["--include", "localhost:" + ",".join(map(str, want["ranks"]))]
    assert_no_gpu_shared(plan)
    for p in plan.workers + (plan.ref,):  # each sees only its GPU, as its cuda:0
        assert p.cuda_visible_devices == str(p.gpus[0]) and p.device == "cuda:0"


def test_pinned_gpus_and_rank_counts_on_8():
    plan = plan_placement(range(8), workers=2, ranks=4)
    assert where(plan)["ranks"] == [0, 1, 2, 3] and plan.idle_gpus == (4,)
    plan = plan_placement(range(8), workers=2, ref_device="cuda:0", worker_gpus=[1, 2], rank_gpus=[4, 5, 6, 7])
    assert where(plan) == {"ref_server": [0], "worker0": [1], "worker1": [2], "ranks": [4, 5, 6, 7],
                           "ds": "--include localhost:4,5,6,7"}
    assert plan.idle_gpus == (3,) and plan.num_ranks == 4
    plan = plan_placement(range(8), workers=1, ref_device="cuda:5")
    assert where(plan)["ref_server"] == [5] and where(plan)["worker0"] == [7]
    assert where(plan)["ranks"] == [0, 1, 2, 3, 4, 6]
    assert_no_gpu_shared(plan)


@pytest.mark.parametrize("kwargs,match", [
    (dict(workers=1, ref_device="cuda:2", worker_gpus=[2]), "GPU 2 is asked for by both ref_server and worker0"),
    (dict(workers=1, worker_gpus=[0], rank_gpus=[0, 1]), "GPU 0 is asked for by both worker0 and rank"),
    (dict(workers=2, worker_gpus=[1]), "one each"),
    (dict(workers=1, rank_gpus=[0, 0]), "a GPU twice"),
    (dict(workers=1, rank_gpus=[0, 9]), r"GPU\(s\) \[9\]"),
    (dict(workers=1, ref_device="cuda:4"), r"GPU\(s\) \[4\]"),
    (dict(workers=1, ranks=3, rank_gpus=[0, 1]), "--gpus 3 but --rank-gpus lists 2"),
    (dict(workers=1, ranks=3), "needs 5 GPUs"),
    (dict(workers=1, ranks=5, share=True), "one rank per GPU"),
    (dict(workers=1, ref_device="gpu"), "auto, cpu or cuda:N"),
])
def test_bad_combinations_are_refused_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_placement(range(4), **kwargs)


def test_sharing_only_when_asked_on_4_gpus():
    plan = plan_placement(range(4), workers=2, share=True, rank_gpus=[0, 1])
    assert where(plan) == {"ref_server": [3], "worker0": [2], "worker1": [1], "ranks": [0, 1],
                           "ds": "--include localhost:0,1"}
    assert [w.vllm_gpu_memory_utilization for w in plan.workers] == [None, 0.3]  # worker0 alone on GPU 2
    plan = plan_placement(range(4), workers=1, share=True, ref_device="cuda:0", worker_gpus=[0])
    assert where(plan)["ranks"] == [0, 1, 2, 3] and plan.workers[0].vllm_gpu_memory_utilization == 0.3
    assert plan_placement(range(4), workers=1, start_ref=False).ref is None  # --ref-url: no ref server here
    assert where(plan_placement(range(4), workers=1, start_ref=False))["ranks"] == [0, 1, 2]


def test_vllm_on_the_gpu_it_was_placed_on():
    assert visible_devices_for("cuda:0", None) is None and visible_devices_for("auto", "3") is None
    assert visible_devices_for("cuda:2", None) == "2"
    assert visible_devices_for("cuda:1", "4,6") == "6"  # the 2nd of the GPUs this process sees
    with pytest.raises(ValueError, match="shows 2 GPU"):
        visible_devices_for("cuda:2", "4,6")


def test_vllm_worker_asked_for_a_gpu_without_cuda_says_so(tiny_model_dir, monkeypatch):
    from common.config import GRPOConfig
    from trainer.engines import make_engine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset")  # recorded: what the engine sets is undone afterwards
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # (a bare delenv of an absent variable would leak it to later tests)
    cfg = GRPOConfig(model=str(tiny_model_dir), gen_backend="vllm", device="cuda:1").validate()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        make_engine(cfg, str(tiny_model_dir))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # before: the engine ignored cfg.device altogether


# ------------------------------------------------------------------ worker hosts, workers spanning GPUs (issue 30)
@pytest.mark.parametrize("n,kwargs,want", [
    (4, dict(workers=2), {"worker0": [3], "worker1": [2]}),
    (8, dict(workers=4, first_worker=2), {"worker2": [7], "worker3": [6], "worker4": [5], "worker5": [4]}),
    (8, dict(workers=2, tp=4), {"worker0": [4, 5, 6, 7], "worker1": [0, 1, 2, 3]}),
    (8, dict(workers=3, worker_gpus=[0, 1, 2]), {"worker0": [0], "worker1": [1], "worker2": [2]}),
])
def test_a_worker_host_gives_each_worker_its_own_gpus(n, kwargs, want):
    plan = plan_placement(range(n), ranks=0, start_ref=False, **kwargs)
    assert plan.ranks is None and plan.ref is None and plan.mode == "own"
    assert {p.name: list(p.gpus) for p in plan.processes} == want
    assert_no_gpu_shared(plan)
    for w in plan.workers:  # each sees only its GPUs; vLLM's tensor-parallel workers take cuda:0..tp-1
        assert w.cuda_visible_devices == ",".join(map(str, w.gpus)) and w.device == "cuda:0"
        assert w.waits_for_ranks == 0


def test_workers_spanning_gpus_in_a_training_run():
    plan = plan_placement(range(8), workers=2, tp=2)
    assert where(plan) == {"ref_server": [7], "worker0": [5, 6], "worker1": [3, 4], "ranks": [0, 1, 2],
                           "ds": "--include localhost:0,1,2"}
    assert_no_gpu_shared(plan)
    with pytest.raises(ValueError, match=r"needs 6 GPUs \(ref server 1, workers 1 x 4 GPUs each, ranks 1\)"):
        plan_placement(range(4), workers=1, tp=4)
    with pytest.raises(ValueError, match="give 2 each"):
        plan_placement(range(8), workers=2, tp=2, worker_gpus=[4, 5, 6])
    with pytest.raises(ValueError, match="only 4 GPU"):
        plan_placement(range(4), workers=1, tp=8, share=True)
    shared = plan_placement(range(2), workers=1, tp=2, share=True)
    assert where(shared)["worker0"] == [0, 1] and shared.workers[0].vllm_gpu_memory_utilization == 0.3


def test_a_vllm_worker_waits_for_the_ranks_only_where_it_shares_their_gpu():
    one = plan_placement([0], workers=1)
    assert one.workers[0].waits_for_ranks == 1 and "once the 1 rank(s) are ready" in describe(one.to_json())
    shared = plan_placement(range(4), workers=2, share=True, rank_gpus=[0, 1])  # worker1 on GPU 1 with a rank
    assert [w.waits_for_ranks for w in shared.workers] == [0, 2]
    assert all(w.waits_for_ranks == 0 for w in plan_placement(range(4), workers=1).workers)  # own GPUs: no wait
    assert plan_placement([0], workers=1, vllm_workers=False).workers[0].waits_for_ranks == 0  # HF: no profiling
    assert plan_placement([0], workers=2, ranks=0, start_ref=False).workers[0].waits_for_ranks == 0  # no ranks


def test_a_tensor_parallel_worker_pinned_to_one_gpu_is_refused(tiny_model_dir):
    from common.config import GRPOConfig
    from trainer.engines import make_engine
    cfg = GRPOConfig(model=str(tiny_model_dir), gen_backend="vllm", device="cuda:1",
                     vllm_tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="spanning 2 GPUs"):
        make_engine(cfg, str(tiny_model_dir))
