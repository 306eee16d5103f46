"""Ranks across hosts, the small parts (issue 23): which interface and address a host uses towards a peer,
how it is named, who writes `latest` on a host other than rank 0's, the resume tag every host must agree on
(real gloo process groups, one process per 'host'), and GET /status's grouping by host."""
from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import psutil
import pytest

from ref_server.status import by_host
from trainer.dist import nodes


def test_interface_towards_a_peer_is_the_routed_one():
    addr = nodes.address_towards("127.0.0.1")
    assert addr == "127.0.0.1" and nodes.interface_of(addr) is None  # loopback: gloo's own default
    assert nodes.address_towards("") is None
    for name, addrs in psutil.net_if_addrs().items():  # any real interface address maps back to its name
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                assert nodes.interface_of(a.address) == name


def test_host_label_carries_the_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert nodes.host_label() == socket.gethostname()  # nothing to route towards: the name alone
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert nodes.host_label() == socket.gethostname()  # loopback says nothing about the host


def test_latest_is_written_by_other_hosts_leaders_only(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    monkeypatch.setenv("CROSS_RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    nodes.write_latest(ds, "step4")
    assert not (ds / "latest").exists()  # host 0: DeepSpeed's own rank 0 writes it
    monkeypatch.setenv("CROSS_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    nodes.write_latest(ds, "step4")
    assert not (ds / "latest").exists()  # not the host's leader
    monkeypatch.setenv("LOCAL_RANK", "0")
    nodes.write_latest(ds, "step4")
    assert (ds / "latest").read_text() == "step4"


def _agree(rank: int, world: int, port: int, ds_dirs: list[str], q) -> None:
    """One 'host': agreed_tag on each case's directory in turn, in one gloo group (every rank gets the same answer
    or raises the same error, so the group stays in step from one case to the next)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    try:
        for d in ds_dirs:
            try:
                out.append(nodes.agreed_tag(Path(d)))
            except ValueError as e:
                out.append(f"error: {e}")
    finally:
        q.put((rank, out))
        dist.destroy_process_group()


CASES = [(("step4", "step4"), "step4"), ((None, None), None), (("step4", None), "error"), (("step4", "step8"), "error")]


@pytest.fixture(scope="module")
def agreed(tmp_path_factory) -> tuple[list[list[Path]], dict]:
    """Every case in one pair of processes (each spawn imports torch: a group per case cost 4x the start-up)."""
    from conftest import find_free_port
    tmp = tmp_path_factory.mktemp("agree")
    dirs = []  # dirs[case][host]
    for c, (tags, _) in enumerate(CASES):
        dirs.append([])
        for i, tag in enumerate(tags):
            d = tmp / f"case{c}" / f"host{i}" / "ds"
            d.mkdir(parents=True)
            if tag:
                (d / "latest").write_text(tag)
            dirs[-1].append(d)
    ctx, port = mp.get_context("spawn"), find_free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, 2, port, [str(d[r]) for d in dirs], q)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    return dirs, out


@pytest.mark.parametrize("case", range(len(CASES)), ids=["same", "none", "one_missing", "different"])
def test_resume_tag_must_agree_across_hosts(agreed, case):
    (tags, expect), (dirs, out) = CASES[case], agreed
    got = {rank: results[case] for rank, results in out.items()}
    if expect == "error":
        for rank in got:  # every rank raises the same error, listing each host's latest
            assert got[rank].startswith("error: --resume"), got
            assert f"{dirs[case][0]}/latest = step4" in got[rank], got
            assert f"{dirs[case][1]}/latest = {tags[1] or 'none'}" in got[rank], got
    else:
        assert got == {0: expect, 1: expect}


def test_status_groups_participants_by_host():
    rows = [{"id": "trainer-rank0", "role": "rank", "host": "a (10.0.0.3)", "addr": "10.0.0.3"},
            {"id": "trainer-rank1", "role": "rank", "host": "b (10.0.0.4)", "addr": "10.0.0.4"},
            {"id": "worker0", "role": "worker", "host": "c", "addr": "10.0.0.5"},
            {"id": "worker1", "role": "worker", "host": "c", "addr": "10.0.0.5"}]
    assert by_host(rows) == [
        {"addr": "10.0.0.3", "host": "a (10.0.0.3)", "ranks": ["trainer-rank0"], "producers": []},
        {"addr": "10.0.0.4", "host": "b (10.0.0.4)", "ranks": ["trainer-rank1"], "producers": []},
        {"addr": "10.0.0.5", "host": "c", "ranks": [], "producers": ["worker0", "worker1"]}]
