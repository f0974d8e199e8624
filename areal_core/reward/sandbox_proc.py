"""Process helpers of the sandbox launcher (stdlib only): dropping a forked child into the sandbox, and
killing whatever a user id left behind."""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import signal

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


def libc():
    return ctypes.CDLL(None, use_errno=True)


def set_limits(lim: dict, nproc: int) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb, lim["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def enter(uid: int | None, lim: dict, work: str, fds: tuple[int, ...], nproc: int) -> None:
    """In a forked child: drop into the sandbox: its own session, ``fds`` as fds 0, 1, 2, ..., every other fd
    closed, user id ``uid`` (None: keep ours), no new privileges, killed with its parent, the limits, ``work``
    as its folder."""
    os.setsid()
    # move every fd out of the way first, so that no target number clobbers a source
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]
    for i, fd in enumerate(high):
        os.dup2(fd, i)  # inheritable
    os.closerange(len(fds), 65536)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    c = libc()
    c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    c.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    set_limits(lim, nproc)
    os.chdir(work)


def make_work(work: str, files: dict[str, bytes], uid: int | None) -> None:
    os.makedirs(work, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
    if uid is not None:
        os.chown(work, uid, uid)
        os.chmod(work, 0o700)


def kill_session(pid: int) -> None:
    """SIGKILL the child's session (a session leader cannot leave its group), and the child itself in case it has
    not reached its ``setsid`` yet."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_uid(uid: int) -> None:
    """SIGKILL every process of user id ``uid`` (that this process's PID namespace holds): a child of ours takes
    that user id and calls ``kill(-1)``, which reaches exactly the processes whose real or saved user id is
    ``uid``; the kernel does it in one pass that a fork cannot outrun. (Having changed user id without an exec,
    the child cannot be traced or read by them.) We must be root."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
            code = 0
        except ProcessLookupError:  # nothing (left) to kill
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"killing the processes of user id {uid} failed (status {status})")


def decode(status: int) -> dict:
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }
