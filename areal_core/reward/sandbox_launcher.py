"""The trusted half of the sandbox: runs one untrusted command and watches it.

Started by :mod:`areal_core.reward.sandbox` as ``python -I -S sandbox_launcher.py DIR``
(stdlib only, so it starts fast). ``DIR`` holds ``spec.json``, ``stdin`` and
``files/``; this script writes the command's output to ``DIR/stdout`` and
``DIR/stderr`` and prints one JSON status line on its own stdout.

In ``namespaces`` mode it runs as root, as PID 1 of fresh PID, mount, network,
IPC and UTS namespaces (made by ``unshare``): it mounts size-limited tmpfs
over /tmp, /var/tmp and /dev/shm, puts the files in /tmp/work, and when it
exits the kernel kills every process left in the PID namespace. In
``rlimits`` mode it runs on the host and kills what is left by user id (when
it could give the command a user id of its own) or by a marker in the
environment.

Either way the command runs in a child that gets its own session, a user id of
its own when we are root, no new privileges, the resource limits, a scrubbed
environment and the work folder as its current directory. The launcher kills
it at the wall-time limit.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
MS_NOSUID, MS_NODEV = 2, 4


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(libc, target: str, size_mb: int, mode: str) -> None:
    opts = f"size={size_mb}m,mode={mode}".encode()
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _set_limits(lim: dict, nproc: int) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb, lim["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _tasks_of_uid(uid: int) -> int:
    """Threads (tasks) owned by ``uid``: what RLIMIT_NPROC counts."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return n


def _exec_child(spec: dict, work: str, fds: tuple[int, int, int], nproc: int) -> None:
    """In the forked child: become the sandboxed command (never returns)."""
    try:
        os.setsid()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(3, 65536)
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        libc = _libc()
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _set_limits(spec["limits"], nproc)
        os.chdir(work)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - report any setup failure on the command's stderr
        os.write(2, f"sandbox setup failed: {e!r}\n".encode())
    os._exit(126)


def _sweep(spec: dict) -> int:
    """Kill every process left behind (rlimits mode); the number killed."""
    killed, me = 0, os.getpid()
    for _ in range(20):  # repeat: a forking process may spawn while we sweep
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                if spec["uid"] is not None:
                    hit = os.stat(f"/proc/{pid}").st_uid == spec["uid"]
                else:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        hit = spec["marker"].encode() in f.read()
                if hit:
                    os.kill(int(pid), signal.SIGKILL)
                    found += 1
            except OSError:
                continue
        killed += found
        if not found:
            break
        time.sleep(0.01)
    return killed


def main(folder: str) -> int:
    with open(os.path.join(folder, "spec.json")) as f:
        spec = json.load(f)
    lim, mode = spec["limits"], spec["mode"]
    fds = (
        os.open(os.path.join(folder, "stdin"), os.O_RDONLY),
        os.open(os.path.join(folder, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        os.open(os.path.join(folder, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
    )
    files = {}
    src = os.path.join(folder, "files")
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            files[name] = f.read()
    libc = _libc()
    if mode == "namespaces":
        _mount_tmpfs(libc, "/tmp", lim["disk_mb"], "1777")
        for d in ("/var/tmp", "/dev/shm"):
            if os.path.isdir(d):
                _mount_tmpfs(libc, d, 1, "1777")
        work = "/tmp/work"
    else:
        work = os.path.join(folder, "work")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.makedirs(work, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
    if spec["uid"] is not None:
        os.chown(work, spec["uid"], spec["uid"])
        os.chmod(work, 0o700)
        nproc = lim["max_processes"]
    else:  # same user id as the host process: the limit counts the user's other tasks too
        nproc = _tasks_of_uid(os.getuid()) + lim["max_processes"]

    t0 = time.monotonic()
    child = os.fork()
    if child == 0:
        _exec_child(spec, work, fds, nproc)
    for fd in fds:
        os.close(fd)
    deadline = t0 + lim["wall_s"]
    status, timed_out = None, False
    while status is None:
        # as PID 1 of a namespace we also reap orphans: wait for any child
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid == child:
            status = st
            break
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(child, signal.SIGKILL)
                except ProcessLookupError:
                    os.kill(child, signal.SIGKILL)
                _, status = os.waitpid(child, 0)
                break
            time.sleep(0.005)
    wall = time.monotonic() - t0
    try:
        os.killpg(child, signal.SIGKILL)  # the command's session, if anything is left in it
    except (ProcessLookupError, PermissionError):
        pass
    leftovers = _sweep(spec) if mode != "namespaces" else 0
    out = {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "timed_out": timed_out,
        "wall_s": wall,
        "leftovers_killed": leftovers,
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0  # as PID 1 (namespaces mode), exiting kills whatever is left in the namespace


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
