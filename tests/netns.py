"""Hosts on one machine: network namespaces linked by veth pairs to a bridge (issue 23's multi-host test).

    with Hosts(["ref", "t0", "t1", "w"]) as hosts:
        hosts.addr["t0"]                       # 10.213.<net>.2
        hosts.cmd("t0", ["python", ...])       # the argv that runs it inside t0's namespace

The bridge lives in a namespace of its own, so nothing touches the root namespace's interfaces; the
addresses exist only inside the namespaces made here, with no route out (no default route). Every
namespace, with everything in it, is removed on exit (also after a failure), and `remove_all` finds
leftovers of this process by name.
"""
from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "grpo23"


def can_make_namespaces() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """One namespace per host name, each with `eth0` on a private /24 and `lo` up."""

    def __init__(self, names: list[str], net: int = 213) -> None:
        tag = f"{PREFIX}-{os.getpid()}-"
        self.bridge_ns = f"{tag}br"
        self.ns = {n: f"{tag}{n}" for n in names}
        subnet = 1 + os.getpid() % 250  # two test processes at once get different /24s
        self.addr = {n: f"10.{net}.{subnet}.{i + 2}" for i, n in enumerate(names)}
        self.made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self.up()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def up(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        self.made.append(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self.made.append(ns)
            port = f"p{i}"  # the bridge's end, in the bridge namespace
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def cmd(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name], *argv]

    def pids(self, name: str) -> list[int]:
        """Processes running in the host's namespace."""
        r = subprocess.run(["ip", "netns", "pids", self.ns[name]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in r.stdout.split()]

    def kill_all(self, name: str) -> None:
        """SIGKILL every process in the host's namespace (the host 'dies')."""
        for pid in self.pids(name):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        """Kill what runs inside, then delete every namespace made (its veth ends go with it)."""
        for ns in reversed(self.made):
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()


def remove_all(pid: int | None = None) -> list[str]:
    """Namespaces left by this process (by name); returns what was removed (a fixture finalizer's net)."""
    tag = f"{PREFIX}-{pid or os.getpid()}-"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    gone = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(tag)]
    for ns in gone:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return gone
