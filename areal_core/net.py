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


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 ``address`` (None: none does, or
    the system cannot say). Linux's SIOCGIFADDR on each interface."""
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None
