"""The limits on all of one answer's processes together (stdlib only; the launcher's and the batch's helper).

The resource limits a process gets (``sandbox_proc.set_limits``) bound each process: ``RLIMIT_AS`` its address
space, ``RLIMIT_NPROC`` the tasks of its user id. A program that forks up to its task limit could still hold that
many times the memory limit. :class:`TreeWatch` bounds the answer's processes as a whole: after ``POLL_S`` seconds,
then at waits growing to ``MAX_POLL_S``, the launcher sums their memory and counts their tasks, and when the sum passes ``memory_mb`` or the count passes
``max_processes``, the run is ended (its processes killed) with that reason.

The answer's processes are those of its user id where it has one of its own (every process it can start keeps
that id), else the launcher's descendants (the launcher is their subreaper, so an orphan stays one of them).
Memory is the proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``: a page shared by n processes counts
1/n in each, so a forked child's copy-on-write pages are not counted twice); it is read only when the resident
sizes (``/proc/PID/statm``, cheap, an upper bound of it) add up to more than the limit.

This is a polled limit (the kernel's cgroups would enforce it at each allocation; this host's cgroup v2 hierarchy
has no memory or pids controller to give a run): between two looks the processes can go past it by what they
allocate between two looks (at most ``MAX_POLL_S`` seconds), each still bound by its own ``RLIMIT_AS``. (Every look
reads ``/proc`` for every process on the host: at a fixed 20 ms, two graders on two cores spent a sixth of their
time looking.)
"""

from __future__ import annotations

import os
import time

POLL_S = 0.02  # the first look, and the next one after it; each later wait half as long again,
MAX_POLL_S = 0.2  # up to this: most programs end within the first looks, a long one costs little to watch
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent, ...); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()


def uid_pids(uid: int) -> list[int]:
    """The living processes of user id ``uid`` (that this process's PID namespace shows; zombies, which hold
    nothing and only wait to be reaped, left out)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
            except OSError:
                continue
            fields = _stat_fields(int(name))
            if fields is not None and fields[0] != b"Z":
                out.append(int(name))
    return out


def _parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def descendant_pids(root: int) -> list[int]:
    """The processes below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent = _parent(int(name))
            if parent is not None:
                children.setdefault(parent, []).append(int(name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0  # gone meanwhile


def _proportional(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return _resident(pid)  # unreadable (another user's, not dumpable): its resident size, an upper bound


def _tasks(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def usage(pids: list[int], max_bytes: int) -> tuple[int, int]:
    """``(tasks, bytes)`` of ``pids`` together; the bytes are exact (proportional) only when more than
    ``max_bytes`` are resident, else their resident sum, which is at least that."""
    tasks = sum(_tasks(p) for p in pids)
    resident = sum(_resident(p) for p in pids)
    if resident <= max_bytes:
        return tasks, resident
    return tasks, sum(_proportional(p) for p in pids)


class TreeWatch:
    """Checks the processes ``pids()`` returns against ``memory_mb`` and ``max_processes`` (the limits of a
    ``SandboxLimits`` as a dict): first after ``POLL_S`` seconds, then at waits growing to ``MAX_POLL_S``."""

    def __init__(self, lim: dict, pids):
        self.max_bytes = lim["memory_mb"] * 2**20
        self.max_tasks = lim["max_processes"]
        self.pids = pids
        self.wait = POLL_S
        self.next = time.monotonic() + POLL_S

    def until_next(self) -> float:
        """Seconds until the next look is due (0 if it is)."""
        return max(0.0, self.next - time.monotonic())

    def check(self) -> str | None:
        """``"memory"`` or ``"processes"`` if the processes are past that limit now, else None."""
        now = time.monotonic()
        if now < self.next:
            return None
        self.wait = min(self.wait * 1.5, MAX_POLL_S)
        self.next = now + self.wait
        tasks, size = usage(self.pids(), self.max_bytes)
        if size > self.max_bytes:
            return "memory"
        if tasks > self.max_tasks:
            return "processes"
        return None
