"""Hosts for tests: Linux network namespaces on a private bridge, made and removed by the test.

``private_hosts(["trainer", "r1", "r2"])`` makes one network namespace per name. The first holds
a bridge (its address ``10.231.0.1``); each other one a veth link into that bridge (``10.231.0.2``,
``.3``, ...). Nothing is added to the namespace the test runs in: the hosts reach each other and
nothing else, and their traffic never leaves the namespaces made here. Each :class:`Host` starts
processes inside its namespace (``ip netns exec``) and stops them by PID when the block ends;
then the namespaces are deleted (which deletes their links).

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2: :func:`unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.231.0"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): tried with a throwaway one."""
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    name = f"af-probe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except RuntimeError as e:
        return f"cannot make a network namespace: {e}"
    _ip("netns", "del", name)
    return None


@dataclass
class Host:
    """One namespace: its address on the bridge, its interface's name, what it runs."""

    name: str
    netns: str
    address: str
    ifname: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, cmd: list[str], host_mounts: bool = False) -> list[str]:
        """``cmd`` run in this host's network namespace. ``ip netns exec`` also gives it a /sys of
        the namespace (without the host's cgroup mounts); ``host_mounts``: keep the host's mounts
        (``nsenter --net``), for a program that needs /sys/fs/cgroup (slurmd)."""
        if host_mounts:
            return ["nsenter", f"--net=/var/run/netns/{self.netns}", *cmd]
        return ["ip", "netns", "exec", self.netns, *cmd]

    def start(
        self, cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None, host_mounts: bool = False
    ) -> subprocess.Popen:
        """Start ``cmd`` in this host (its own session; output to ``log_path``); stopped at the end."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                self.command(cmd, host_mounts),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.procs.append(proc)  # `ip netns exec` and nsenter exec the command: this is its PID
        return proc

    def python(self, code: str, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> str:
        """Run ``code`` with this interpreter in this host; its stdout (an error names its stderr)."""
        proc = subprocess.run(
            self.command([sys.executable, "-c", code]),
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"on host {self.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return proc.stdout

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@contextlib.contextmanager
def private_hosts(names: list[str]) -> Iterator[dict[str, Host]]:
    tag = uuid.uuid4().hex[:6]
    hosts = {n: Host(n, f"af-{tag}-{n}", f"{SUBNET}.{k + 1}", "br0" if k == 0 else "eth0") for k, n in enumerate(names)}
    hub = hosts[names[0]]
    made: list[str] = []
    try:
        for h in hosts.values():
            _ip("netns", "add", h.netns)
            made.append(h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
        _ip("-n", hub.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub.netns, "addr", "add", f"{hub.address}/24", "dev", "br0")
        _ip("-n", hub.netns, "link", "set", "br0", "up")
        for k, h in enumerate(list(hosts.values())[1:], start=1):
            port = f"p{k}"  # the bridge's end of this host's link (made in the hub: never in ours)
            _ip("-n", hub.netns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("-n", hub.netns, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
        yield hosts
    finally:
        for h in hosts.values():
            h.stop()
        for ns in made:
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
