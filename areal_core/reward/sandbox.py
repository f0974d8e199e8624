"""Run untrusted programs (a model's code) with limits, isolated as far as the host allows.

Two modes, ``namespaces`` and ``rlimits``; ``sandbox_modes`` says what each
one isolates, which one this host runs (:func:`sandbox_mode`, forced with
``AREAL_SANDBOX_MODE``) and what each guarantees (:data:`GUARANTEES`,
:func:`guarantees`); its names are importable from here too. docs/EVALUATION.md
explains the guarantees, and :func:`require_strong` refuses to grade in
training where one is missing, unless the config says so.

:func:`run_with_checker` runs a program beside a trusted checker process that
talks to it over two pipes: the checker gets a work folder and (when we are
root) a user id of its own, so the program can neither read the checker's
files nor signal, trace or read the checker (``code.py`` uses it for assert
tests, with ``code_rpc.py``). :func:`run_each` runs several programs one
after another in one sandbox run, each in a process and under a user id of its
own forked from a clean zygote (``sandbox_batch``).

Every sandboxed process runs under the seccomp filter of ``sandbox_seccomp`` (where this machine takes it:
``guarantees()["syscall_filter"]``), and the launcher ends a run whose processes together pass the memory or
process limit (``sandbox_tree``; :attr:`SandboxRun.limit`). Whether the program's process entered the sandbox
is said by trusted code on a channel of its own (:attr:`SandboxRun.setup_error`; a batch: a byte per job), so
no exit code of the program's can feign or hide a failed setup.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace

from areal_core.reward.sandbox_modes import (  # noqa: F401 - re-exported: callers import them from here
    GUARANTEES,
    MISSING,
    MODES,
    UNSHARE_FLAGS,
    _is_root,
    _probe_namespaces,
    _probe_netns,
    _root_layout,
    guarantees,
    missing_guarantees,
    sandbox_mode,
    sandbox_python,
)

log = logging.getLogger(__name__)
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
_UID_BASE, _UID_SPAN = 2_000_000, 1 << 30  # sandbox user ids: unused by any real account, never reused in practice


class WeakSandboxError(RuntimeError):
    """Training would grade code in a sandbox that lacks a guarantee, and the config does not allow it."""


_warned: set[str] = set()


def require_strong(allow_weak: bool) -> str:
    """For training (``reward.allow_weak_sandbox``): this host's mode, if it gives every guarantee;
    else, with ``allow_weak``, the mode with a warning that names what is missing, and without it
    :class:`WeakSandboxError`. (A policy under RL learns to use whatever the sandbox lets it reach.)"""
    mode = sandbox_mode()
    missing = missing_guarantees(mode)
    if not missing:
        return mode
    what = "; ".join(MISSING[k] for k in missing)
    why = {"rlimits": f" (namespaces mode: {_probe_namespaces() or 'available, but not chosen'})"}.get(mode, "")
    if not allow_weak:
        raise WeakSandboxError(
            f"the code sandbox runs in mode {mode!r}{why}, which does not guarantee: {what}. Training refuses to "
            "grade code there; run the reward workers as root with util-linux `unshare` (namespaces mode), or set "
            "reward.allow_weak_sandbox: true to grade anyway"
        )
    if mode not in _warned:
        _warned.add(mode)
        log.warning(
            "grading code in a weak sandbox (reward.allow_weak_sandbox: true): mode %r%s does not guarantee: %s",
            mode,
            why,
            what,
        )
    return mode


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    # each process's address space, and the memory of all the program's processes together (``sandbox_tree``)
    memory_mb: int = 1024
    max_processes: int = 32  # tasks (processes and threads) of the program, all together
    file_size_mb: int = 16  # any file written, stdout and stderr included
    disk_mb: int = 64  # size of the private /tmp (namespaces mode)
    max_open_files: int = 256


@dataclass
class SandboxRun:
    mode: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    leftovers_killed: int = 0
    limit: str | None = None  # "memory" or "processes": its processes together went past that limit (killed)
    setup_error: str | None = None  # it never ran: the sandbox could not be set up (said by trusted code only)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.limit is None and self.setup_error is None

    def reason(self) -> str:
        if self.setup_error is not None:
            return f"sandbox setup failed: {self.setup_error[:200]}"
        if self.timed_out:
            return "wall time limit exceeded"
        if self.limit is not None:
            return f"{'memory' if self.limit == 'memory' else 'process'} limit exceeded (all its processes together)"
        if self.signal is not None:
            import signal as _signal

            names = {
                _signal.SIGXCPU: "CPU time limit exceeded",
                _signal.SIGXFSZ: "file/output size limit exceeded",
                _signal.SIGKILL: "killed",
            }
            return names.get(self.signal, f"killed by signal {self.signal}")
        if self.exit_code != 0:
            last = self.stderr.strip().splitlines()[-1:] or [""]
            return f"exit code {self.exit_code}: {last[0][:200]}"
        return "ok"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CheckedRun:
    """A program run beside a checker (:func:`run_with_checker`); ``timed_out`` and ``wall_s`` are the run's."""

    program: SandboxRun
    checker: SandboxRun


def scrubbed_env(marker: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/nonexistent",
        "PYTHONDONTWRITEBYTECODE": "1",
        "AREAL_SANDBOX_RUN": marker,
    }


def run_sandboxed(
    argv: list[str],
    files: dict[str, str | bytes],
    stdin: str = "",
    limits: SandboxLimits | None = None,
    mode: str | None = None,
) -> SandboxRun:
    """Run ``argv`` in a fresh work folder holding ``files``, under ``limits``.

    ``argv[0]`` must be an absolute path (no PATH lookup). Output beyond
    ``limits.file_size_mb`` kills the command (SIGXFSZ).
    """
    return _run(argv, files, stdin, limits, mode, None)[0]


def run_with_checker(
    argv: list[str],
    files: dict[str, str | bytes],
    checker_files: dict[str, str | bytes],
    checker_script: str,
    checker_args: tuple[str, ...] = (),
    limits: SandboxLimits | None = None,
    mode: str | None = None,
) -> CheckedRun:
    """Run ``argv`` (untrusted, empty stdin) beside a trusted checker, both under ``limits``.

    The checker is the Python script ``checker_script`` (one of
    ``checker_files``), run with ``sys.argv = [checker_script, *checker_args]``
    in a fork of the launcher (:func:`sandbox_python`, ``-I -S``) that first
    drops into the sandbox. It reads the program's fd 4 on its fd 4 and writes
    the program's fd 3 on its fd 3; its stdin is empty. Each has its own work
    folder (the checker's is unreadable by the program where the sandbox has
    its own user ids: ``guarantees(mode)["own_user"]``) and its own stdout and
    stderr. The run ends when the checker exits (the program is then killed)
    or at the wall-time limit.
    """
    if checker_script not in checker_files:
        raise ValueError(f"checker script {checker_script!r} is not among the checker's files")
    program, checker = _run(argv, files, "", limits, mode, (checker_script, tuple(checker_args), checker_files))
    return CheckedRun(program, checker)


def _write_files(folder: str, files: dict[str, str | bytes]) -> None:
    os.makedirs(folder, mode=0o700)
    for name, data in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"sandbox file names must be plain names, got {name!r}")
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def _start(limits: SandboxLimits | None, mode: str | None) -> tuple[SandboxLimits, str, str, dict]:
    """``(limits, mode, marker, spec)``: what every run's spec holds."""
    limits = limits or SandboxLimits()
    mode = mode or sandbox_mode()
    if mode not in MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}")
    marker = secrets.token_hex(8)
    spec = {
        "mode": mode,
        "env": scrubbed_env(marker),
        "marker": marker,
        "limits": asdict(limits),
        "netns": mode == "rlimits" and bool(guarantees(mode)["no_network"]),
        "syscall_filter": bool(guarantees(mode)["syscall_filter"]),
        "root": _root_layout() if mode == "namespaces" else None,
    }
    return limits, mode, marker, spec


def _new_uid(taken=()) -> int:
    while (uid := _UID_BASE + secrets.randbelow(_UID_SPAN)) in taken:
        pass
    return uid


def _launch_in(folder: str, spec: dict, limits: SandboxLimits, marker: str) -> dict:
    """Write ``spec`` into ``folder`` and run the launcher on it (with the sandboxed interpreter: after it
    dropped into the sandbox, whatever it imports must be the interpreter's there); its status."""
    if spec["mode"] == "namespaces":
        os.mkdir(os.path.join(folder, "root"), 0o700)  # where the launcher mounts the sandbox's root
    with open(os.path.join(folder, "spec.json"), "w") as f:
        json.dump(spec, f)
    cmd = [sandbox_python(), "-I", "-S", LAUNCHER, folder]
    if spec["mode"] == "namespaces":
        cmd = ["unshare", *UNSHARE_FLAGS, *cmd]
    return _launch(cmd, limits, marker)


def _run(argv, files, stdin, limits, mode, checker) -> tuple[SandboxRun, SandboxRun | None]:
    if not os.path.isabs(argv[0]):
        raise ValueError(f"argv[0] must be an absolute path, got {argv[0]!r}")
    limits, mode, marker, spec = _start(limits, mode)
    uid = _new_uid() if _is_root() else None
    spec.update(argv=argv, uid=uid, checker=None)
    folder = tempfile.mkdtemp(prefix="areal-sandbox-")
    try:
        os.chmod(folder, 0o711)  # the sandbox user may pass through to work/, read nothing else
        _write_files(os.path.join(folder, "files"), files)
        with open(os.path.join(folder, "stdin"), "wb") as f:
            f.write(stdin.encode())
        if checker is not None:
            # 0700 (the launcher's user only) until the launcher copies them into the checker's own work folder
            os.mkdir(os.path.join(folder, "checker"), 0o700)
            _write_files(os.path.join(folder, "checker", "files"), checker[2])
            spec["checker"] = {
                "script": checker[0],
                "args": list(checker[1]),
                "uid": _new_uid({uid}) if _is_root() else None,
            }
        status = _launch_in(folder, spec, limits, marker)

        def result(where: str, st: dict) -> SandboxRun:
            return SandboxRun(
                mode=mode,
                exit_code=st["exit_code"],
                signal=st["signal"],
                timed_out=status["timed_out"],
                wall_s=status["wall_s"],
                stdout=_read_capped(os.path.join(where, "stdout"), limits),
                stderr=_read_capped(os.path.join(where, "stderr"), limits),
                leftovers_killed=status["leftovers_killed"],
                limit=status.get("limit") if where == folder else None,
                setup_error=status.get("setup_error") if where == folder else None,
            )

        program = result(folder, status)
        if checker is None:
            return program, None
        return program, result(os.path.join(folder, "checker"), status.get("checker") or _KILLED)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_each(
    runner: str,
    prepare: str,
    entry: str,
    jobs: list[bytes],
    limits: SandboxLimits | None = None,
    mode: str | None = None,
) -> list[SandboxRun] | None:
    """Run ``jobs`` one after another in one sandbox run, none able to reach another (``sandbox_batch``).

    ``runner`` is the source of a Python module (stdlib only); its ``prepare()`` runs once, in a
    zygote that never holds any job's input or output; each job runs in a process forked from it,
    under a user id of its own, with a private ``/tmp`` (``namespaces``) or work folder
    (``rlimits``), that calls ``entry(job, 3)`` and writes its output on fd 3. Each job gets
    ``limits`` (``wall_s`` each; the output of all jobs together is capped at ``file_size_mb``).
    Per job a :class:`SandboxRun` whose ``stdout`` is what it wrote on fd 3 (``stderr`` is empty:
    fds 0-2 are /dev/null); None when the run failed as a whole. Needs user ids of its own
    (``guarantees()["own_user"]``)."""
    if not guarantees(mode)["own_user"]:
        raise ValueError(
            f"run_each needs user ids of its own for its jobs (root); mode {mode or sandbox_mode()!r} has none here"
        )
    limits, mode, marker, spec = _start(limits, mode)
    uids: set[int] = set()
    for _ in jobs:
        uids.add(_new_uid(uids))
    spec["batch"] = {
        "prepare": prepare,
        "entry": entry,
        "uids": sorted(uids),
        "max_bytes": limits.file_size_mb * 2**20 // (len(jobs) + 1),
    }
    folder = tempfile.mkdtemp(prefix="areal-sandbox-")
    try:
        os.chmod(folder, 0o711)
        _write_files(os.path.join(folder, "files"), {"runner.py": runner})
        os.mkdir(os.path.join(folder, "jobs"), 0o700)  # root only: each job's process reads its own before it drops
        for k, job in enumerate(jobs):
            with open(os.path.join(folder, "jobs", str(k)), "wb") as f:
                f.write(job)
        status = _launch_in(folder, spec, replace(limits, wall_s=(limits.wall_s + 1) * len(jobs) + 5), marker)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if status.get("batch") is None:
        log.warning(
            "a batched sandbox run of %d jobs failed as a whole: %s", len(jobs), status.get("batch_error") or status
        )
        return None
    return [
        SandboxRun(
            mode=mode,
            exit_code=r["exit_code"],
            signal=r["signal"],
            timed_out=r["timed_out"],
            wall_s=r["wall_s"],
            stdout=r["out"],
            stderr="",
            limit=r["limit"],
        )
        for r in status["batch"]
    ]


_KILLED = {"exit_code": None, "signal": 9}


def _launch(cmd: list[str], limits: SandboxLimits, marker: str) -> dict:
    """Run the launcher; its last stdout line is the JSON status."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=scrubbed_env(marker),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limits.wall_s + 30)  # the launcher enforces wall_s itself
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise RuntimeError(f"sandbox launcher did not finish within {limits.wall_s + 30:.0f}s") from None
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode < 0:
        # the launcher was killed (a same-user program can do that in rlimits mode without root):
        # the run failed; sweep whatever it left, then report it as killed
        return {
            "exit_code": None,
            "signal": -proc.returncode,
            "timed_out": False,
            "wall_s": 0.0,
            "leftovers_killed": _sweep_marker(marker),
            "limit": None,
            "setup_error": None,
        }
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"sandbox launcher failed (exit {proc.returncode}): {err.decode(errors='replace')[-1000:]}")
    return json.loads(lines[-1])


def _sweep_marker(marker: str) -> int:
    """SIGKILL every process whose environment holds the run's marker; how many."""
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"AREAL_SANDBOX_RUN={marker}".encode() in f.read():
                    os.kill(int(pid), 9)
                    killed += 1
        except OSError:
            continue
    return killed


def _read_capped(path: str, limits: SandboxLimits) -> str:
    """The file's text (capped); empty when the launcher was killed before it made the file."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return f.read(limits.file_size_mb * 1024 * 1024).decode(errors="replace")


def run_python(
    source: str,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    mode: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> SandboxRun:
    """Run a Python program (``main.py``) in the sandbox with this interpreter, isolated (-I)."""
    files = {"main.py": source, **(extra_files or {})}
    return run_python_file("main.py", files, stdin, limits, mode)


def run_python_file(
    main: str,
    files: dict[str, str],
    stdin: str = "",
    limits: SandboxLimits | None = None,
    mode: str | None = None,
    args: tuple[str, ...] = (),
) -> SandboxRun:
    return run_sandboxed([sandbox_python(), "-I", main, *args], files, stdin, limits, mode)
