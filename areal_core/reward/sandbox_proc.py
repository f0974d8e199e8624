"""Process helpers of the sandbox launcher (stdlib only): dropping a forked child into the sandbox, and
killing whatever a user id left behind."""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import signal
import time

import sandbox_seccomp as seccomp
import sandbox_tree as tree

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


def enter(
    uid: int | None, lim: dict, work: str, fds: tuple[int, ...], nproc: int, syscall_filter: bool, report: int = -1
) -> int:
    """In a forked child: drop into the sandbox: its own session, ``fds`` as fds 0, 1, 2, ..., every other fd
    closed, user id ``uid`` (None: keep ours), no new privileges, killed with its parent, the limits, ``work``
    as its folder, and (``syscall_filter``) the seccomp filter (``sandbox_seccomp``).

    ``report`` (if >= 0) is kept too, close-on-exec, at the number returned (-1 without one): the trusted
    channel on which the caller says that the process entered the sandbox, before anything untrusted runs."""
    os.setsid()
    # move every fd out of the way first, so that no target number clobbers a source
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (*fds, report) if fd >= 0]
    for i, fd in enumerate(high[: len(fds)]):
        os.dup2(fd, i)  # inheritable
    kept = -1
    if report >= 0:
        kept = os.dup2(high[-1], len(fds), inheritable=False)
    os.closerange(len(fds) + (report >= 0), 65536)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    c = libc()
    if c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    c.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    set_limits(lim, nproc)
    os.chdir(work)
    if syscall_filter:
        seccomp.install()
    return kept


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
    ``uid``, in one pass that a fork cannot outrun. (Having changed user id without an exec, the child cannot be
    traced or read by them; but they can signal it: if one kills it before its ``kill(-1)``, another child
    tries, and should each be killed, we signal what is left of ``uid`` ourselves, as root, until nothing is:
    the process limit bounds how many there can be.) We must be root."""
    for _ in range(10):
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
        if status == 0:
            return
    deadline = time.monotonic() + 10
    while left := tree.uid_pids(uid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"killing the processes of user id {uid} failed: {len(left)} left")
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def decode(status: int) -> dict:
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }
