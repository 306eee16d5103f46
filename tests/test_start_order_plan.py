"""Issue 42, start-up order on a shared GPU and GPUs named by UUID / MIG instance: the plan (who waits for whom),
launch.sh --print-plan with a fake `nvidia-smi`, and the ranks' and workers' view of who is up (GET /status rows).
The real handshake between processes: tests/test_start_order.py."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, subprocess_env

from common.placement.launch_plan import smi_uuids, visible_gpus
from common.placement.plan import plan_placement
from trainer.run.start_order import WorkersStarting, started_workers

SMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa0000-1111)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb0000-2222)
  MIG 3g.40gb     Device  0: (UUID: MIG-11111111-aaaa)
  MIG 3g.40gb     Device  1: (UUID: MIG-22222222-bbbb)
"""


def launch(tmp_path, mode: str, visible: str | None, *args: str) -> subprocess.CompletedProcess:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / "nvidia-smi").write_text("#!/bin/sh\n[ \"$1\" = \"-L\" ] || exit 9\ncat <<'X'\n" + SMI + "X\n")
    (d / "nvidia-smi").chmod(0o755)
    env = subprocess_env(PYTHONPATH=str(REPO), PATH=f"{d}:{os.environ['PATH']}", GRPO_PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(["bash", str(REPO / "launch.sh"), mode, "--print-plan", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_vllm_workers_on_one_gpu_start_one_after_the_other_and_the_ranks_wait_for_them():
    plan = plan_placement([0], workers=3)
    assert [w.starts_after for w in plan.workers] == [(), ("worker0",), ("worker0", "worker1")]
    assert plan.ranks_wait_for == ("worker0", "worker1", "worker2")
    own = plan_placement([0, 1, 2, 3], workers=2)
    assert [w.starts_after for w in own.workers] == [(), ()] and own.ranks_wait_for == ()
    hf = plan_placement([0], workers=2, vllm_workers=False)
    assert [w.starts_after for w in hf.workers] == [(), ()] and hf.ranks_wait_for == ()


def test_print_plan_hands_the_order_to_the_workers_and_the_ranks(tmp_path):
    proc = launch(tmp_path, "train", "0", "--workers", "2", "--", "--gen_backend", "vllm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "--start_after worker0" in lines[2] and "--start_after" not in lines[1], lines
    assert lines[-1].endswith("--gen_wait_for_workers worker0,worker1"), lines
    assert "starts after worker0 (same GPU)" in proc.stderr


def test_gpus_named_by_uuid_or_mig_instance():
    found, uuids = smi_uuids(SMI)
    assert found == [0, 1] and uuids["MIG-22222222-bbbb"] == 1 and uuids["GPU-aaaa0000-1111"] == 0
    assert visible_gpus("GPU-bbbb,0", found, uuids) == ([1, 0], {})  # a unique prefix, as CUDA takes it
    gpus, names = visible_gpus("MIG-11111111-aaaa,MIG-22222222-bbbb", found, uuids)
    assert names == {gpus[0]: "MIG-11111111-aaaa", gpus[1]: "MIG-22222222-bbbb"} and not set(gpus) & {0, 1}
    for bad in ("GPU-cccc", "MIG-33333333-cccc", "GPU-"):  # unknown, unknown, ambiguous: one line each
        try:
            visible_gpus(bad, found, uuids)
        except ValueError as e:
            assert bad in str(e)
        else:
            raise AssertionError(bad)


def test_launch_accepts_uuids_and_gives_mig_instances_to_workers(tmp_path):
    proc = launch(tmp_path, "train", "GPU-bbbb0000-2222,GPU-aaaa0000-1111", "--workers", "1", "--ref-device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "worker0: CUDA_VISIBLE_DEVICES=0 " in proc.stdout and "localhost:1" in proc.stdout, proc.stdout  # by UUID
    mig = launch(tmp_path, "workers", "MIG-11111111-aaaa,MIG-22222222-bbbb", "--workers", "2",
                 "--ref-url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run"), "--", "--gen_backend", "vllm")
    assert mig.returncode == 0, mig.stderr
    assert [line.split()[1] for line in mig.stdout.splitlines()] == ["CUDA_VISIBLE_DEVICES=MIG-22222222-bbbb",
                                                                    "CUDA_VISIBLE_DEVICES=MIG-11111111-aaaa"]
    ranks = launch(tmp_path, "train", "MIG-11111111-aaaa,MIG-22222222-bbbb", "--workers", "1", "--ref-device", "cpu")
    assert ranks.returncode == 2 and "MIG instances" in ranks.stderr and "Traceback" not in ranks.stderr


class FakeClient:
    def __init__(self, rows):
        self.rows, self.asked = rows, 0

    def status(self, timeout=None):
        self.asked += 1
        return {"participants": self.rows}


def test_a_rank_does_not_generate_while_a_worker_on_its_gpu_starts():
    rows = [{"id": "worker0", "role": "worker", "last_heartbeat_ago_s": 1.0, "state": "waiting for 2 trainer rank(s)"},
            {"id": "worker1", "role": "worker", "last_heartbeat_ago_s": 1.0, "state": "generating round 3"},
            {"id": "worker2", "role": "worker", "last_heartbeat_ago_s": 99.0, "state": "starting"}]
    assert started_workers({"participants": rows}, fresh_s=25) == ["worker1"]

    class Cfg:
        gen_wait_for_workers, heartbeat_s, wait_for_ranks_timeout = ["worker0"], 10.0, 1800.0
    client = FakeClient(rows)
    starting = WorkersStarting(Cfg, client, poll=0.0)
    assert starting.still_starting()
    rows[0]["state"] = "starting"  # its engine is up (its Heartbeat runs)
    assert not starting.still_starting() and not starting.still_starting() and client.asked == 2
    Cfg.gen_wait_for_workers, Cfg.wait_for_ranks_timeout = ["worker2"], 0.0  # never comes: the rank goes on
    assert not WorkersStarting(Cfg, FakeClient(rows), poll=0.0).still_starting()
    Cfg.gen_wait_for_workers = []
    assert not WorkersStarting(Cfg, FakeClient(rows)).still_starting()
