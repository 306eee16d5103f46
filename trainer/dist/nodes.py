"""Ranks across hosts with no shared filesystem (issue 23): which rank writes what on its own host, and how
a host is named in errors and in the ref server's status table.

DeepSpeed's launcher (`deepspeed --no_ssh --node_rank R ...`, or its hostfile mode) tells each rank its
node through CROSS_RANK / CROSS_SIZE and LOCAL_RANK. Every host keeps its own run directory: its ranks'
DeepSpeed shards, its own `latest` and data-order state (written by the host's local rank 0, the "node
leader"); the HF checkpoints, `final` and metrics are written where rank 0 runs.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def node_rank() -> int:
    return int(os.environ.get("CROSS_RANK", 0))


def num_nodes() -> int:
    return int(os.environ.get("CROSS_SIZE", 1))


def is_node_leader() -> bool:
    """Local rank 0: writes this host's own copy of what every host needs to resume."""
    return local_rank() == 0


def address_towards(peer: str | None) -> str | None:
    """This host's address on the route to `peer` (no packet is sent); None when there is no route."""
    if not peer:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str | None) -> str | None:
    """The network interface holding `address` (a loopback address: None, gloo then picks its default)."""
    if not address or address.startswith("127.") or address == "::1":
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def host_label(towards: str | None = None) -> str:
    """hostname (address): the address towards the rendezvous (or `towards`), so that hosts sharing a name
    (containers, network namespaces) are still told apart in errors and in GET /status."""
    name = socket.gethostname()
    addr = address_towards(towards or os.environ.get("MASTER_ADDR"))
    return f"{name} ({addr})" if addr and not addr.startswith("127.") else name


def write_latest(ds_dir: Path, tag: str) -> None:
    """DeepSpeed writes `latest` on global rank 0 only: the other hosts' leaders write their own."""
    if is_node_leader() and node_rank() > 0:
        ds_dir.mkdir(parents=True, exist_ok=True)
        tmp = ds_dir / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ds_dir / "latest")


def agreed_tag(ds_dir: Path) -> str | None:
    """The checkpoint tag every rank resumes from: each host's own `latest`, which must agree (all ranks
    call this; they all get the same answer, or all raise the same error naming the hosts)."""
    import torch

    latest = ds_dir / "latest"
    mine = latest.read_text().strip() if latest.is_file() else None
    seen: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(seen, (host_label(), str(ds_dir), mine))
    tags = {tag for _, _, tag in seen}
    if len(tags) == 1:
        return tags.pop()
    where = "; ".join(sorted({f"{h}: {d}/latest = {t or 'none'}" for h, d, t in seen}))
    raise ValueError(f"--resume: the hosts' run directories hold different checkpoints ({where}); every "
                     "host must keep its own run directory of the same run (same --output_dir)")
