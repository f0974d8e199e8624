"""This host's ports and addresses: a free port to listen on, and the address a peer reaches."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host``:``port`` (the interface the kernel would send
    from; a UDP connect sends nothing). Where a host has several networks, the one a peer reaches."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]
