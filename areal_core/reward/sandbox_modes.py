"""Which sandbox mode this host can run, what each mode guarantees, and the interpreter sandboxed programs use.

``namespaces`` (root and util-linux ``unshare``): fresh PID, mount, network,
IPC and UTS namespaces; a fresh root holding only the interpreter and its
standard library, read-only, and a size-limited private ``/tmp``
(``sandbox_rootfs``); a user id of its own; every process killed when the run
ends.

Both modes filter system calls (``sandbox_seccomp``, where this machine takes the filter) and bound an
answer's processes together (``sandbox_tree``; in ``rlimits`` only as root, where the watching launcher is out
of the program's reach).

``rlimits`` (the fallback, e.g. a container without ``CAP_SYS_ADMIN``):
resource limits, scrubbed environment, fresh work folder, its own session; a
user id of its own and an empty network namespace only where we are root and
the kernel lets us make one. The host's files stay readable (as far as their
permissions let the sandbox's user read them).

:func:`sandbox_mode` picks the strongest mode that works here, and
``AREAL_SANDBOX_MODE=namespaces|rlimits`` forces one (forcing ``namespaces``
where it cannot work is an error, never a silent downgrade). :data:`GUARANTEES`
says exactly what each mode guarantees and :func:`guarantees` what it
guarantees on this host. ``sandbox`` runs programs in these modes; the names
its callers use are importable from it too.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

from areal_core.reward import sandbox_rootfs, sandbox_seccomp

MODES = ("namespaces", "rlimits")
UNSHARE_FLAGS = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
_PR_SET_NO_NEW_PRIVS = 38

# What each mode guarantees (True) or does not (False). Tests assert these.
GUARANTEES = {
    "namespaces": {
        "limits": True,  # CPU, wall time, memory, processes, file size, output size
        "scrubbed_env": True,
        "no_network": True,  # an empty network namespace
        "host_files_hidden": True,  # a fresh root: the interpreter and its standard library, read-only
        "writes_confined": True,  # only the run's private /tmp
        "disk_bounded": True,  # tmpfs of limits.disk_mb
        "own_user": True,  # cannot signal or read other processes; per-run process limit
        "all_processes_killed": True,
        "aggregate_limits": True,  # memory and processes of an answer's processes together (sandbox_tree)
        "syscall_filter": None,  # filled in below: the seccomp filter, where this machine takes it
    },
    "rlimits": {
        "limits": True,
        "scrubbed_env": True,
        "no_network": None,  # filled in below: True where we can make a network namespace (root)
        "host_files_hidden": False,  # whatever the sandbox's user may read on the host, it reads
        "writes_confined": False,  # world-writable host folders (/tmp) stay writable
        "disk_bounded": False,  # only the size of each file is bounded
        "own_user": None,  # filled in below: True when running as root
        "all_processes_killed": None,  # by user id as root; by environment marker otherwise
        "aggregate_limits": None,  # filled in below: as root (the watching launcher is out of the program's reach)
        "syscall_filter": None,
    },
}
# what is at stake where a guarantee is missing (the refusal to grade in training says it)
MISSING = {
    "limits": "resource limits",
    "scrubbed_env": "a scrubbed environment",
    "no_network": "no network (programs can connect to the scheduler, workers, rollout servers on this host)",
    "host_files_hidden": "hidden host files (programs can read the checkout, the data sets' expected outputs, "
    "the run folder)",
    "writes_confined": "confined writes (programs can write world-writable host folders)",
    "disk_bounded": "bounded disk use",
    "own_user": "a user id of its own (programs can signal and read the grader's processes)",
    "all_processes_killed": "killing every process a program started",
    "aggregate_limits": "limits on an answer's processes together (only each process is bounded: its memory "
    "limit times its process limit in all)",
    "syscall_filter": "a system call filter (programs can call unshare, mount, ptrace, bpf, keyctl: the kernel "
    "interfaces escapes start from)",
}


def _is_root() -> bool:
    return os.geteuid() == 0


def guarantees(mode: str | None = None) -> dict:
    mode = mode or sandbox_mode()
    g = dict(GUARANTEES[mode])
    if mode == "rlimits":
        g["own_user"] = _is_root()
        # without an own user id, a process that clears its environment escapes the sweep
        g["all_processes_killed"] = _is_root()
        # without one, the program can kill the launcher that watches its processes
        g["aggregate_limits"] = _is_root()
        g["no_network"] = _probe_netns() is None
    g["syscall_filter"] = _probe_seccomp() is None
    return g


def missing_guarantees(mode: str | None = None) -> list[str]:
    """The guarantees ``mode`` (default: this host's) does not give."""
    return [k for k, v in guarantees(mode).items() if not v]


def _probe_namespaces() -> str | None:
    """None if the namespaces mode works here, else why not."""
    if not _is_root():
        return "not running as root"
    if shutil.which("unshare") is None:
        return "util-linux `unshare` not found"
    try:
        r = subprocess.run(["unshare", *UNSHARE_FLAGS, "true"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`unshare` probe timed out"
    if r.returncode != 0:
        return f"`unshare` failed: {r.stderr.decode(errors='replace').strip()[:200]}"
    try:
        _root_layout()
    except OSError as e:
        return f"cannot lay out the sandbox's root: {e}"
    return None


@functools.cache
def _probe_netns() -> str | None:
    """None if the launcher can make a network namespace of its own here (rlimits mode), else why not."""
    if not _is_root():
        return "not running as root"
    r = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({sandbox_rootfs.CLONE_NEWNET}))",
        ],
        capture_output=True,
        timeout=20,
    )
    return None if r.returncode == 0 else "unshare(CLONE_NEWNET) refused (no CAP_SYS_ADMIN?)"


@functools.cache
def _probe_seccomp() -> str | None:
    """None if the sandboxed interpreter can install the seccomp filter (``sandbox_seccomp``) here, else why not."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not sandbox_seccomp.supported():
        return f"no seccomp filter for {os.uname().machine}"
    code = (
        f"import ctypes, sys; sys.path.append({here!r}); import sandbox_seccomp; "
        f"ctypes.CDLL(None).prctl({_PR_SET_NO_NEW_PRIVS}, 1, 0, 0, 0); sandbox_seccomp.install()"
    )
    r = subprocess.run([sandbox_python(), "-I", "-S", "-c", code], capture_output=True, timeout=20)
    return None if r.returncode == 0 else f"the kernel refused it: {r.stderr.decode(errors='replace')[-200:]}"


@functools.cache
def _root_layout() -> dict:
    """What the namespaces mode's root holds (``sandbox_rootfs.layout`` of :func:`sandbox_python`)."""
    return sandbox_rootfs.layout(sandbox_python())


@functools.cache
def sandbox_mode() -> str:
    forced = os.environ.get("AREAL_SANDBOX_MODE")
    if forced:
        if forced not in MODES:
            raise ValueError(f"AREAL_SANDBOX_MODE={forced!r}: expected one of {', '.join(MODES)}")
        if forced == "namespaces" and (why := _probe_namespaces()):
            raise RuntimeError(f"AREAL_SANDBOX_MODE=namespaces but namespaces are unavailable: {why}")
        return forced
    return "namespaces" if _probe_namespaces() is None else "rlimits"


def _usable_by_others(path: str) -> bool:
    """True if a user with no relation to the file's owner can execute ``path``."""
    path = os.path.realpath(path)
    if os.stat(path).st_mode & 0o005 != 0o005:
        return False
    folder = os.path.dirname(path)
    while True:
        if not os.stat(folder).st_mode & 0o001:
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)


@functools.cache
def sandbox_python() -> str:
    """The interpreter sandboxed programs run with.

    ``AREAL_SANDBOX_PYTHON`` if set; else this interpreter, when the sandbox
    user can execute it (as root the sandbox runs under a user id of its own,
    which cannot enter e.g. a 0700 /root holding a pyenv Python); else the
    system ``python3``.
    """
    forced = os.environ.get("AREAL_SANDBOX_PYTHON")
    if forced:
        return forced
    if not _is_root() or _usable_by_others(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _usable_by_others(candidate):
            return candidate
    raise RuntimeError(
        f"no Python the sandbox user can run: {sys.executable} is not executable by other users and there is "
        "no /usr/bin/python3; set AREAL_SANDBOX_PYTHON to an interpreter readable by all users"
    )
