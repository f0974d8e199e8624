"""The filesystem a ``namespaces`` sandbox sees: a fresh root holding only the interpreter (stdlib only).

Two halves, stdlib only:

* :func:`layout` (on the host, once per process): what the sandboxed interpreter needs, found by
  asking it (``sys.path`` under ``-S``: its standard library) and ``ldd`` (the shared libraries of
  the executable and of the standard library's extension modules). Symlinks on the way to each
  (``/lib -> usr/lib``, ``/usr/bin/python3 -> python3.11``) are recreated, the files and folders at
  their ends are bind-mounted read-only. ``site-packages``/``dist-packages`` folders inside the
  standard library are covered with an empty folder.
* :func:`enter_root` (in the launcher, root, in a private mount namespace): builds that root on a
  tmpfs (``/dev/null``, ``zero``, ``random``, ``urandom``; ``/proc`` showing only the caller's own
  processes; a size-limited ``/tmp``), ``pivot_root``\\ s into it, detaches the old root, and makes
  the root read-only. Nothing of the host is left: no checkout, no data, no home, no ``/etc``, no
  other run's files. Every later import must come from the bound standard library.
"""

from __future__ import annotations

import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
DEVICES = ("null", "zero", "random", "urandom")
_PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'executable': sys.executable, 'path': [p for p in sys.path if os.path.isdir(p)]}))\n"
)
_MAX_LINKS = 40  # symlinks followed for one path


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def unshare(libc, flags: int) -> None:
    _check(libc.unshare(flags), f"unshare({flags:#x})")


# ---------------------------------------------------------------------------------------------------------------
# On the host: what the root holds.


def _replicate(path: str, links: dict[str, str], binds: set[str]) -> None:
    """Make ``path`` resolve in the new root as on the host: the symlinks on its way recreated, the file or
    folder it ends at bound."""
    for _ in range(_MAX_LINKS):
        parts = [p for p in os.path.normpath(path).split("/") if p]
        cur = "/"
        for i, part in enumerate(parts):
            nxt = os.path.join(cur, part)
            if os.path.islink(nxt):
                target = os.readlink(nxt)
                links[nxt] = target
                path = os.path.normpath(os.path.join(cur, target, *parts[i + 1 :]))
                break
            cur = nxt
        else:
            binds.add(cur)
            return
    raise OSError(f"too many symlinks on the way to {path}")


def _shared_libraries(files: list[str]) -> list[str]:
    """The shared libraries ``files`` load, as the dynamic loader names them (``ldd``)."""
    import re
    import subprocess

    out = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60).stdout
    libs = set()
    for line in out.splitlines():
        m = re.match(r"\s+(?:\S+ => )?(/\S+) \(0x", line)
        if m:
            libs.add(m.group(1))
    return sorted(libs)


def layout(python: str) -> dict:
    """The new root's contents for the interpreter ``python`` (absolute path): ``{"links": {path: target},
    "binds": [path], "hide": [path]}``. Raises ``OSError`` where it cannot be found out (no ``ldd``, say)."""
    import json
    import subprocess

    r = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise OSError(f"{python} failed: {r.stderr.strip()[-300:]}")
    info = json.loads(r.stdout)
    stdlib = sorted(os.path.realpath(p) for p in info["path"])
    modules = [os.path.join(d, n) for d in stdlib for n in sorted(os.listdir(d)) if n.endswith(".so")]
    try:
        libs = _shared_libraries([os.path.realpath(python), *modules])
    except FileNotFoundError:
        raise OSError("`ldd` not found: cannot tell which shared libraries the interpreter needs") from None
    if not libs:
        raise OSError(f"`ldd` found no shared libraries for {python}")
    links: dict[str, str] = {}
    binds: set[str] = set()
    for p in (python, *stdlib, *libs):
        _replicate(p, links, binds)
    # a bind inside another one is there already
    binds = {b for b in binds if not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds)}
    links = {k: v for k, v in links.items() if not any(k.startswith(o.rstrip("/") + "/") for o in binds)}
    hide = [
        os.path.join(d, n)
        for d in stdlib
        for n in ("site-packages", "dist-packages")
        if os.path.isdir(os.path.join(d, n))
    ]
    return {"links": links, "binds": sorted(binds), "hide": hide}


# ---------------------------------------------------------------------------------------------------------------
# In the launcher (root, in its own mount, PID, network, IPC and UTS namespaces).


def _parent(root: str, path: str) -> str:
    """``path`` under the new root ``root``, with its parent folders made."""
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    return target


def _bind(libc, source: str, target: str, flags: int) -> None:
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    mount(libc, source, target, None, MS_BIND)
    mount(libc, None, target, None, MS_REMOUNT | MS_BIND | flags)


def enter_root(spec: dict, at: str, tmp_mb: int) -> None:
    """Build the root of ``spec`` (:func:`layout`) on a tmpfs mounted at ``at`` (an empty folder), and
    make it this process's root; its cwd is then ``/``. Nothing outside it stays reachable."""
    libc = _libc()
    mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    mount(libc, "tmpfs", at, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, target in sorted(spec["links"].items()):
        os.symlink(target, _parent(at, path))
    for path in spec["binds"]:
        _bind(libc, path, _parent(at, path), MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in spec["hide"]:
        mount(libc, "tmpfs", at + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    for dev in DEVICES:
        _bind(libc, f"/dev/{dev}", _parent(at, f"/dev/{dev}"), MS_NOSUID | MS_NOEXEC)
    os.symlink("/tmp", at + "/dev/shm")
    os.mkdir(at + "/proc", 0o555)
    # hidepid=2: a process sees only its own user's processes (not the launcher's, not another program's)
    mount(libc, "proc", at + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    os.mkdir(at + "/tmp", 0o755)
    mount(libc, "tmpfs", at + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    os.chdir(at)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(f"pivot_root: unknown system call number on {os.uname().machine}")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")  # the old root is now stacked under the new one
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def private_tmp(tmp_mb: int) -> None:
    """A ``/tmp`` (and System V IPC) of this process's own, gone with its last process (a program of a batch)."""
    libc = _libc()
    unshare(libc, CLONE_NEWNS | CLONE_NEWIPC)
    mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
