"""The trusted half of the sandbox: runs one untrusted command and watches it.

Started by :mod:`areal_core.reward.sandbox` as ``python -I -S sandbox_launcher.py DIR`` with the
sandboxed interpreter (stdlib only, so it starts fast; its helpers ``sandbox_proc``,
``sandbox_rootfs`` and ``sandbox_batch`` sit beside it). ``DIR`` holds ``spec.json``, ``stdin``
and ``files/``; this script writes the command's output to ``DIR/stdout`` and ``DIR/stderr`` and
prints one JSON status line on its own stdout.

In ``namespaces`` mode it runs as root, as PID 1 of fresh PID, mount, network, IPC and UTS
namespaces (made by ``unshare``): it opens what it needs of ``DIR``, then moves into a fresh root
that holds only the interpreter and its standard library, read-only, a ``/proc`` that shows each
user only its own processes, and a size-limited ``/tmp`` (``sandbox_rootfs``); the files go to
``/tmp/work``. When it exits the kernel kills every process left in the PID namespace. In
``rlimits`` mode it runs on the host (in a network namespace of its own where it can make one) and
kills what is left by user id (when it could give the command a user id of its own) or by a marker
in the environment.

Either way the command runs in a child that gets its own session, a user id of its own when we
are root, no new privileges, the resource limits, the seccomp filter (``sandbox_seccomp``), a scrubbed
environment and the work folder as its current directory. A setup failure is written on a close-on-exec
pipe that the command's ``exec`` closes, so only trusted code writes it (the status's ``setup_error``). The
launcher kills the command at the wall-time limit, or when its processes together pass the memory or
process limit (``sandbox_tree``; the status's ``limit``).

With a ``checker`` in the spec (``DIR/checker/`` holds its files; it writes
``DIR/checker/stdout`` and ``stderr``), a trusted Python script runs beside the command under the
same limits, in a work folder of its own and, when we are root, under a second user id of its own,
so the command can neither read its files nor signal, trace or read it. The checker is a fork of
this launcher that drops into the sandbox (user id, limits, fds, work folder) and then runs the
script in the already started interpreter: no second interpreter start-up, and, having changed user
id without an exec, it is not even dumpable. Two pipes join them: the checker writes requests on its
fd 3 that the command reads on its fd 3, and the command answers on its fd 4, read by the checker on
its fd 4. The run ends when the checker ends (the command is then killed) or at the wall-time limit.

With a ``batch`` in the spec, several programs run one after another, each in a process and under
a user id of its own, none able to reach another (``sandbox_batch``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _helper(name: str):
    """Import the helper module ``name`` beside this file (-I leaves the script's folder out of the path): last
    on the path, and only meanwhile, so that no file beside it (math.py, code.py) can stand in for a standard
    module."""
    sys.path.append(_HERE)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(_HERE)


proc = _helper("sandbox_proc")
rootfs = _helper("sandbox_rootfs")
tree = _helper("sandbox_tree")


def _exec_child(spec: dict, work: str, fds: tuple[int, ...], nproc: int, report: int) -> None:
    """In the forked child: become the sandboxed command (never returns). A setup failure (before the exec,
    or the exec itself) is written on ``report``, which the exec closes: the command cannot write it."""
    kept = report
    try:
        kept = proc.enter(spec["uid"], spec["limits"], work, fds, nproc, spec["syscall_filter"], report)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - any setup failure is reported on the setup channel
        try:
            os.write(kept, f"{e!r}"[:500].encode())
        except OSError:
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
    os._exit(126)


def _run_checker(spec: dict, work: str, fds: tuple[int, ...], nproc: int) -> None:
    """In the forked child: drop into the sandbox as the checker, then run its Python script in this
    interpreter (no second interpreter start-up; never returns). Nothing of the checker's runs before the
    user id, the limits and the fds are those of the sandbox."""
    code = 126
    try:
        proc.enter(spec["uid"], spec["limits"], work, fds, nproc, spec["syscall_filter"])
        code = 1
        script = spec["script"]
        with open(script) as f:
            source = f.read()
        sys.argv = [script, *spec["args"]]
        exec(compile(source, script, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if e.code is not None and not isinstance(e.code, int):
            os.write(2, f"{e.code}\n".encode())
    except BaseException:  # noqa: BLE001 - reported on the checker's stderr; the run fails on its exit code
        import traceback

        os.write(2, traceback.format_exc().encode())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken by the script: nothing more to write
            pass
    os._exit(code)


def _sweep(spec: dict) -> int:
    """Kill every process left behind (rlimits mode); the number killed."""
    killed, me = 0, os.getpid()
    uids = {spec["uid"], (spec.get("checker") or {}).get("uid")} - {None}
    for _ in range(20):  # repeat: a forking process may spawn while we sweep
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                if uids:
                    hit = os.stat(f"/proc/{pid}").st_uid in uids
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


def _open_io(folder: str, stdin: str) -> tuple[int, int, int]:
    return (
        os.open(stdin, os.O_RDONLY),
        os.open(os.path.join(folder, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        os.open(os.path.join(folder, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
    )


def _read_files(src: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            files[name] = f.read()
    return files


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


def _read_report(fd: int) -> str | None:
    """What the child wrote on its setup channel before its exec (None: nothing, it entered the sandbox)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    os.close(fd)
    return data.decode(errors="replace") if data else None


def _watch(spec: dict, child: int, checker: int | None):
    """The limits on the command's processes together (``sandbox_tree``): those of its user id, else the
    launcher's descendants but the checker."""
    if spec["uid"] is not None:
        return tree.TreeWatch(spec["limits"], lambda: tree.uid_pids(spec["uid"]))
    me = os.getpid()
    return tree.TreeWatch(spec["limits"], lambda: [p for p in tree.descendant_pids(me) if p != checker])


def _kill_command(spec: dict, child: int) -> None:
    """Kill the command's processes now (it went past a limit of all of them together)."""
    if spec["uid"] is not None:
        proc.kill_uid(spec["uid"])
        return
    for pid in [child, *tree.descendant_pids(os.getpid())]:
        proc.kill_session(pid)


def _supervise(spec: dict, work: str, chk_work: str, fds: tuple, chk_fds: tuple | None, nproc: int) -> dict:
    """Fork the command (and the checker), wait for the one that ends the run, kill what is left; the status."""
    lim, chk = spec["limits"], spec.get("checker")
    t0 = time.monotonic()
    to_close = list(fds)
    if chk:
        req_r, req_w = os.pipe()  # checker -> command
        resp_r, resp_w = os.pipe()  # command -> checker
        fds = (*fds, req_r, resp_w)
        to_close += [*chk_fds, req_r, req_w, resp_r, resp_w]
    if spec["syscall_filter"]:
        proc.seccomp.program()  # made once, before the forks that install it
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        _exec_child(spec, work, fds, nproc, report_w)
    os.close(report_w)
    checker = None
    if chk:
        checker = os.fork()
        if checker == 0:
            _run_checker({**spec, **chk}, chk_work, (*chk_fds, req_w, resp_r), nproc)
    for fd in to_close:
        os.close(fd)
    setup_error = _read_report(report_r)
    main_pid = checker if chk else child  # the run ends when this one ends
    deadline, watch = t0 + lim["wall_s"], _watch(spec, child, checker)
    statuses, timed_out, limit = {}, False, None
    while main_pid not in statuses and setup_error is None:
        # as PID 1 of a namespace (or the subreaper) we also reap orphans: wait for any child
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid in (child, checker):
            statuses[pid] = st
        elif pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                break
            limit = watch.check()
            if limit is not None:
                _kill_command(spec, child)
                break
            time.sleep(0.005)
    wall = time.monotonic() - t0
    for pid in (child, checker):
        if pid is not None and pid not in statuses:
            proc.kill_session(pid)
            _, statuses[pid] = os.waitpid(pid, 0)
        if pid is not None:
            proc.kill_session(pid)  # whatever is left in its session
    return {
        **proc.decode(statuses[child]),
        "timed_out": timed_out,
        "wall_s": wall,
        "limit": limit,
        "setup_error": setup_error,
        "checker": proc.decode(statuses[checker]) if chk else None,
    }


def main(folder: str) -> int:
    with open(os.path.join(folder, "spec.json")) as f:
        spec = json.load(f)
    lim, mode, chk = spec["limits"], spec["mode"], spec.get("checker")
    if mode != "namespaces":
        proc.libc().prctl(proc.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # what the command leaves behind stays ours (a descendant, for the limits on its processes together)
        proc.libc().prctl(proc.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if spec["netns"]:  # a network namespace of the run's own, with nothing in it
            rootfs.unshare(proc.libc(), rootfs.CLONE_NEWNET)
    if spec.get("batch"):
        out = _helper("sandbox_batch").main(folder, spec)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        return 0
    fds = _open_io(folder, os.path.join(folder, "stdin"))
    files = _read_files(os.path.join(folder, "files"))
    chk_fds = None
    if chk:
        chk_folder = os.path.join(folder, "checker")
        chk_fds = _open_io(chk_folder, os.devnull)
        chk_files = _read_files(os.path.join(chk_folder, "files"))
    if mode == "namespaces":
        rootfs.enter_root(spec["root"], os.path.join(folder, "root"), lim["disk_mb"])
        work, chk_work = "/tmp/work", "/tmp/check"
    else:
        work, chk_work = os.path.join(folder, "work"), os.path.join(folder, "check")
    proc.make_work(work, files, spec["uid"])
    if chk:
        proc.make_work(chk_work, chk_files, chk["uid"])
    # the host process's own user id: the limit counts the user's other tasks too
    nproc = lim["max_processes"] if spec["uid"] is not None else _tasks_of_uid(os.getuid()) + lim["max_processes"]
    out = _supervise(spec, work, chk_work, fds, chk_fds, nproc)
    out["leftovers_killed"] = _sweep(spec) if mode != "namespaces" else 0
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0  # as PID 1 (namespaces mode), exiting kills whatever is left in the namespace


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
