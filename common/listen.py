"""The ref server's listening socket, and the check that a port is free for it (trainer/check.py): one function, so
the check binds exactly what the server will bind (its host, SO_REUSEADDR) and a port left in TIME-WAIT by a run
that just ended counts as free, as it is for the server. And free ports for the project's scripts: `free_port` (the
OS's pick, for a listener bound at once) and `free_port_for_later` (launch.sh's DeepSpeed master port, bound seconds
later). The one definition outside tests/ (issue 64)."""
from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound and listening on host:port (raises OSError when the port is taken)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers only, never a listener
        sock.bind(addr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        lo, hi = PORT_RANGE_FILE.read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host`, as the OS hands out for bind(0): for a server the caller starts right away (a ref
    server, a demo's or bench's run). A listener bound seconds later wants free_port_for_later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_for_later(host: str = "127.0.0.1") -> int:
    """A port free now, for a listener that binds it seconds later (the ranks' rendezvous). Drawn outside the
    ephemeral range: a port the OS hands out for bind(0) comes from that range, from which every outgoing connection
    meanwhile takes its source port (the suite saw a run's ranks fail with EADDRINUSE on such a master port)."""
    lo, hi = ephemeral_range()
    candidates = [*range(10000, lo), *range(hi + 1, 65536)]
    draw = random.SystemRandom()
    for _ in range(min(100, len(candidates))):
        port = draw.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no free port outside the range: the OS's pick, as before
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # launch.sh: `python -m common.listen` prints a master port
    print(free_port_for_later())
