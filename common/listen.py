"""The ref server's listening socket, and the check that a port is free for it (trainer/check.py): one function, so
the check binds exactly what the server will bind (its host, SO_REUSEADDR) and a port left in TIME-WAIT by a run
that just ended counts as free, as it is for the server."""
from __future__ import annotations

import socket


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
