"""The launcher's batch: several programs, one after another, in one sandbox run, none able to reach another.

Started by ``sandbox_launcher.py`` for a spec with a ``batch`` (``sandbox.run_each``). Three kinds of
process, each its own:

* the **launcher** (root): talks to the host; per job it picks nothing, decides nothing about the program's
  output, and never sees a job's input (the host wrote the jobs to ``DIR/jobs/K``, a folder only root
  can read). It reads each job's output from a pipe of that job's own, up to a cap, kills the job at its
  wall time, and prints every job's output and status as one JSON line at the end.
* the **zygote** (root): forked from the launcher *before* the launcher has read anything of any job's,
  it loads the runner's source and its ``prepare`` (the imports programs take for granted, once) and then
  only forks: for job K it gets a user id and the write end of K's output pipe from the launcher (over a
  socket, with the fd), forks K's process, waits for it, kills every process of K's user id if any is
  left (``kill(-1)`` from a child taking that id; as a subreaper it is the ancestor of all of them)
  and reports K's exit status. It
  never holds any job's input or output, so nothing of one program's run is in the memory the next one
  is forked from.
* job K's **process**: still root, it reads its own job file, takes a private ``/tmp`` (a tmpfs of
  ``disk_mb`` in a mount namespace of its own, and System V IPC of its own: ``namespaces`` mode) or a
  work folder of its own (``rlimits`` mode), then drops into the sandbox (user id of its own, no new
  privileges, limits, the seccomp filter, fds 0-2 on /dev/null, fd 3 its output pipe, nothing else),
  writes one byte on its setup channel (a pipe to the zygote, closed at once: nothing after it can write
  there, so only trusted code says whether it entered the sandbox) and calls the runner's ``entry(job, 3)``.

The launcher also ends a job whose processes together pass the memory or process limit (``sandbox_tree``).

So a program cannot reach another program's input, output, channel, memory, processes or files: other
user ids, other pipes, and nothing of theirs in its own memory. User ids are not reused within a run.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time

import sandbox_proc as proc
import sandbox_rootfs as rootfs
import sandbox_tree as tree

SETUP_FAILED = 126  # the exit code of a job's process that could not drop into the sandbox


def main(folder: str, spec: dict) -> dict:
    """Run the batch of ``spec`` (after the namespaces, before anything of a job's is read)."""
    lim, batch = spec["limits"], spec["batch"]
    jobs_fd = os.open(os.path.join(folder, "jobs"), os.O_RDONLY | os.O_DIRECTORY)
    with open(os.path.join(folder, "files", "runner.py")) as f:
        runner = f.read()
    base = None
    if spec["mode"] == "namespaces":
        rootfs.enter_root(spec["root"], os.path.join(folder, "root"), 1)  # each job mounts a /tmp of its own
    else:
        base = os.path.join(folder, "work")
        os.mkdir(base, 0o711)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = os.fork()
    if zygote == 0:
        mine.close()
        _zygote(spec, runner, jobs_fd, theirs, base)
    theirs.close()
    os.close(jobs_fd)
    results, error = [], None
    for k, uid in enumerate(batch["uids"]):
        try:
            results.append(_job(mine, k, uid, lim, batch["max_bytes"]))
        except (OSError, ValueError) as e:  # the zygote is gone or said something else than two numbers
            error = f"job {k}: the zygote failed: {e!r}"
            break
        if not results[-1].pop("entered"):  # told by trusted code only: no program can claim or deny it
            error = f"job {k}: its process could not enter the sandbox"
            break
    mine.close()
    proc.kill_session(zygote)
    os.waitpid(zygote, 0)
    return {"batch": results if error is None else None, "batch_error": error}


def _job(sock: socket.socket, k: int, uid: int, lim: dict, cap: int) -> dict:
    """Job ``k``: its output (at most ``cap`` bytes, then it is killed), whether it ran past its wall time or
    its processes together past their memory or process limit (``sandbox_tree``), its exit status, whether its
    process entered the sandbox. Returns once the zygote has killed everything of ``uid``'s."""
    t0 = time.monotonic()
    r, w = os.pipe()
    socket.send_fds(sock, [f"{k} {uid}".encode()], [w])
    os.close(w)
    pid = int(_recv(sock, t0 + lim["wall_s"] + 30))
    os.set_blocking(r, False)
    deadline, limits = t0 + lim["wall_s"], tree.TreeWatch(lim, lambda: tree.uid_pids(uid))
    out, timed_out, limit, killed, reply, watch = bytearray(), False, None, False, None, [r, sock]
    while reply is None:
        left = None if killed else max(0.0, min(deadline - time.monotonic(), limits.until_next()))
        ready = select.select(watch, [], [], left)[0]
        if not ready and not killed:
            if time.monotonic() >= deadline:
                timed_out = killed = True
                proc.kill_session(pid)
            elif (limit := limits.check()) is not None:
                killed = True
                proc.kill_uid(uid)
            continue
        if r in ready:
            chunk = _read(r)
            if chunk is None:
                watch.remove(r)  # end of file: every writer is gone
            else:
                out += chunk
                if len(out) > cap and not killed:
                    killed = True
                    proc.kill_session(pid)
        if sock in ready:
            reply = _recv(sock, time.monotonic() + 30).split()
    status, entered = int(reply[0]), reply[1] == b"1"
    wall = time.monotonic() - t0
    while len(out) <= cap and (chunk := _read(r)):  # all writers are dead now: what is left in the pipe
        out += chunk
    os.close(r)
    return {
        "out": bytes(out[:cap]).decode(errors="replace"),
        "timed_out": timed_out,
        "limit": limit,
        "wall_s": wall,
        "entered": entered,
        **proc.decode(status),
    }


def _read(fd: int) -> bytes | None:
    """What the pipe holds now (b"" if nothing yet), None at its end."""
    try:
        return os.read(fd, 1 << 16) or None
    except BlockingIOError:
        return b""


def _recv(sock: socket.socket, deadline: float) -> bytes:
    if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
        raise OSError("no answer from the zygote")
    msg = sock.recv(64)
    if not msg:
        raise OSError("the zygote exited")
    return msg


# ---------------------------------------------------------------------------------------------------------------
# The zygote and the jobs' processes.


def _zygote(spec: dict, runner: str, jobs_fd: int, sock: socket.socket, base: str | None) -> None:
    """Load the runner, then fork one process per job the launcher asks for (never returns)."""
    code = 1
    try:
        c = proc.libc()
        c.prctl(proc.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        c.prctl(proc.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # what a job leaves behind is ours to reap
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):  # fd 2 stays the launcher's stderr (the host's): where a setup failure is told
            os.dup2(null, fd)
        ns = {"__name__": "code_rpc", "__builtins__": __builtins__}
        exec(compile(runner, "code_rpc.py", "exec"), ns)
        import site

        site.main()  # what `python -I` gives a program (exit(), quit(), the site folders), as in a run of its own
        ns[spec["batch"]["prepare"]]()
        entry = ns[spec["batch"]["entry"]]
        if spec["syscall_filter"]:
            proc.seccomp.program()  # made once here, inherited by every job's process
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
            if not msg:
                code = 0
                break
            k, uid = map(int, msg.split())
            (w,) = fds
            entered_r, entered_w = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                _job_process(k, uid, spec, jobs_fd, (w, entered_w), null, base, entry)
            os.close(w)
            os.close(entered_w)
            sock.send(str(pid).encode())
            status = _wait(pid)
            entered = os.read(entered_r, 1) == b"1"  # the job's process ended: its write end is closed
            os.close(entered_r)
            if _reap():  # something of the job's is left (as our subreaper's child, or its descendant)
                proc.kill_uid(uid)
                _reap()
            if base is not None:
                import shutil

                shutil.rmtree(os.path.join(base, str(k)), ignore_errors=True)
            sock.send(f"{status} {int(entered)}".encode())
    except BaseException:  # noqa: BLE001 - the launcher sees the zygote gone and fails the batch
        import traceback

        os.write(2, traceback.format_exc().encode())
    os._exit(code)


def _wait(pid: int) -> int:
    """``pid``'s exit status, reaping any orphan that ends meanwhile."""
    while True:
        got, status = os.waitpid(-1, 0)
        if got == pid:
            return status


def _reap() -> bool:
    """Reap what has ended; whether any child is left. As a subreaper we are an ancestor of every process a
    job started (an orphan comes to us; nothing leaves our subtree), so none left means nothing of the
    job's is alive."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        return False
    return True


def _job_process(k: int, uid: int, spec: dict, jobs_fd: int, pipes: tuple, null: int, base: str | None, entry) -> None:
    """Job ``k``'s process: read its job, drop into the sandbox, say so on the setup channel (``pipes``: the
    output pipe's and the setup channel's write ends), close it, run ``entry(job, 3)`` (never returns)."""
    code, lim = SETUP_FAILED, spec["limits"]
    try:
        fd = os.open(str(k), os.O_RDONLY, dir_fd=jobs_fd)
        with os.fdopen(fd, "rb") as f:
            job = f.read()
        if base is None:
            rootfs.private_tmp(lim["disk_mb"])
            work = "/tmp/work"
        else:
            work = os.path.join(base, str(k))
        proc.make_work(work, {}, uid)
        w, entered = pipes
        entered = proc.enter(
            uid, lim, work, (null, null, null, w), lim["max_processes"], spec["syscall_filter"], entered
        )
        os.write(entered, b"1")
        os.close(entered)  # nothing after this (the program) can write it
        code = 1
        entry(job, 3)
        code = 0
    except BaseException as e:  # noqa: BLE001 - a setup failure fails the batch (SETUP_FAILED, no output)
        if code == SETUP_FAILED:
            os.write(2, f"job {k}: sandbox setup failed: {e!r}\n".encode())
    os._exit(code)
