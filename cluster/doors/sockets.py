"""The doors' ports: ``PortInUse`` (what both servers raise for a busy port, naming the config field and the flag that
set it), ``bind_socket`` (the HTTP server's listening socket, never shared: no SO_REUSEPORT; the gRPC server binds its
own with ``grpc.so_reuseport`` off) and ``check_port`` (both doors' ports, before anything starts: cluster/server.py).
"""

from __future__ import annotations

import errno
import socket


class PortInUse(ValueError):
    def __init__(self, host: str, port: int, why: str = "in use", field: str = "gateway.port", flag: str = "--port"):
        super().__init__(
            f"{field}: {host}:{port} is {why}; stop what holds it or choose another port ({flag}, 0 picks a free one)"
            if field == "gateway.port"
            else f"{field}: {host}:{port} is {why}; stop what holds it or choose another port ({flag}; 'any' picks "
            "a free one, 0 turns HTTP off)"
        )


def bind_socket(host: str, port: int, field: str = "gateway.port", flag: str = "--port") -> socket.socket:
    """A listening-ready socket bound to ``host:port`` (0: any free port), without SO_REUSEPORT: a busy port is
    PortInUse, never shared with whatever holds it. SO_REUSEADDR as servers set it: a port in TIME_WAIT is free."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"gateway.host: cannot resolve {host!r}: {e}") from None
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        why = "in use" if e.errno == errno.EADDRINUSE else f"not available ({(e.strerror or str(e)).lower()})"
        raise PortInUse(host, port, why, field, flag) from None
    return s


def check_port(host: str, port: int, field: str = "gateway.port", flag: str = "--port") -> None:
    """Raise PortInUse now, before anything starts, if the gateway could not bind ``host:port`` (0: any)."""
    if port == 0:
        return
    bind_socket(host, port, field, flag).close()
