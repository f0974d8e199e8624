"""The local Prefect stack: a Prefect server (SQLite) and a process worker on 127.0.0.1,
with prefect.yaml deployed. For users who want the UI.

    python -m infra.stack up [--port 4200]    # or: areal-flow stack up
    python -m infra.stack status
    python -m infra.stack down

State (the Prefect home with its SQLite database, logs, and ``stack.json`` with the
PIDs) lives in ``runs/.stack`` (``AREAL_STACK_HOME`` overrides). Each process is
started in its own session, so its PID is its process group; ``down`` stops the
worker with SIGINT (a worker ignores SIGTERM for a minute), then the server, waits
for every process of both groups (flow runs the worker started included) to exit,
and checks that none is left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from areal_core.net import free_port
from areal_core.storage.fsutil import write_text_atomic

REPO = Path(__file__).resolve().parent.parent
POOL = "areal-local"
DEFAULT_PORT = 4200


class StackError(RuntimeError):
    pass


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def prefect_exe() -> str:
    """The ``prefect`` command of this Python's environment."""
    exe = Path(sys.executable).parent / "prefect"
    if not exe.exists():
        raise StackError(f"prefect not found next to {sys.executable}")
    return str(exe)


def _http(url: str, data: dict | None = None, timeout: float = 5.0):
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _group(pgid: int) -> list[psutil.Process]:
    """Live processes whose process group is ``pgid`` (a process we started as a session leader)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def stop_group(pid: int, first: signal.Signals, grace_s: float, log=print, role: str = "") -> None:
    """Signal the group led by ``pid`` (a session we started), wait, then SIGKILL what is left."""
    members = _group(pid)
    if not members:
        return
    try:
        os.killpg(pid, first)
    except ProcessLookupError:
        return
    _, alive = psutil.wait_procs(members, timeout=grace_s)
    if alive:
        names = []
        for p in alive:
            try:
                names.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
            except psutil.Error:
                names.append(str(p.pid))
        log(
            f"  {role} group {pid}: {len(alive)} process(es) still running {grace_s:.0f}s after {first.name}, "
            f"SIGKILL: {names}"
        )
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
    # late children (e.g. a flow run started while stopping) of the same group
    for p in _group(pid):
        p.kill()


def wait_healthy(api_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the Prefect server ``proc`` answers ``api_url``'s health check; StackError if it exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"prefect server exited with {proc.returncode}")
        try:
            _http(f"{api_url}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise StackError(f"prefect server not healthy after {timeout_s:.0f}s")


class Stack:
    def __init__(
        self,
        home: str | os.PathLike | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        query_seconds: float = 5.0,
    ):
        self.home = Path(home or os.environ.get("AREAL_STACK_HOME") or REPO / "runs" / ".stack").resolve()
        self.state_path = self.home / "stack.json"
        self.port = port
        self.extra_env = dict(env or {})
        self.query_seconds = query_seconds

    # -- state ---------------------------------------------------------------
    def state(self) -> dict | None:
        if not self.state_path.exists():
            return None
        return json.loads(self.state_path.read_text())

    @property
    def api_url(self) -> str:
        s = self.state()
        if not s:
            raise StackError("the stack is not running")
        return s["api_url"]

    def env(self, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PREFECT_HOME": str(self.home / "prefect"),
                "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_WORKER_QUERY_SECONDS": str(self.query_seconds),
                "AREAL_FLOW_HOME": str(REPO),
            }
        )
        env.update(self.extra_env)
        return env

    # -- up --------------------------------------------------------------------
    def up(self, timeout_s: float = 120.0, log=print, deploy: bool = True, worker: bool = True) -> dict:
        """Start the server; then (by default) deploy prefect.yaml and start the worker."""
        s = self.state()
        if s and any(psutil.pid_exists(s[k]) for k in ("server_pid", "worker_pid")):
            raise StackError(f"already running (UI {s['ui_url']}); `down` first")
        port = self.port or (DEFAULT_PORT if _port_free(DEFAULT_PORT) else free_port())
        env = self.env(port)
        (self.home / "prefect").mkdir(parents=True, exist_ok=True)
        exe = prefect_exe()
        state = {
            "port": port,
            "api_url": env["PREFECT_API_URL"],
            "ui_url": f"http://127.0.0.1:{port}",
            "home": str(self.home),
            "server_pid": None,
            "worker_pid": None,
        }
        try:
            with open(self.home / "server.log", "ab") as out:
                server = subprocess.Popen(
                    [exe, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=str(REPO),
                    start_new_session=True,
                )
            state["server_pid"] = server.pid
            self._write_state(state)
            wait_healthy(state["api_url"], server, timeout_s)
            log(f"server up: {state['ui_url']}")
            if deploy:
                self._cli(env, ["work-pool", "create", POOL, "--type", "process", "--overwrite"], log)
                self._cli(env, ["--no-prompt", "deploy", "--all"], log)
                log("deployments from prefect.yaml deployed")
            if not worker:
                return state
            with open(self.home / "worker.log", "ab") as out:
                worker = subprocess.Popen(
                    [exe, "worker", "start", "--pool", POOL, "--name", f"{POOL}-worker"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=str(REPO),
                    start_new_session=True,
                )
            state["worker_pid"] = worker.pid
            self._write_state(state)
            self._wait_worker(state["api_url"], worker, timeout_s)
        except BaseException:
            log(f"start failed; stopping what was started (logs in {self.home})")
            self.down(log=log)
            raise
        log(f"worker up (pool {POOL})")
        log(f"Prefect UI: {state['ui_url']}")
        log(f"to send CLI runs there: export PREFECT_API_URL={state['api_url']}")
        return state

    def _write_state(self, state: dict) -> None:
        write_text_atomic(str(self.state_path), json.dumps(state, indent=2))

    def _cli(self, env: dict, args: list[str], log) -> None:
        r = subprocess.run([prefect_exe(), *args], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
        with open(self.home / "deploy.log", "a") as f:
            f.write(f"$ prefect {' '.join(args)}\n{r.stdout}\n{r.stderr}\n")
        if r.returncode != 0:
            raise StackError(
                f"`prefect {' '.join(args)}` failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )

    @staticmethod
    def _wait_worker(api_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"prefect worker exited with {proc.returncode}")
            workers = _http(f"{api_url}/work_pools/{POOL}/workers/filter", data={})
            if any(w.get("status") == "ONLINE" for w in workers):
                return
            time.sleep(0.5)
        raise StackError(f"worker did not come online within {timeout_s:.0f}s")

    # -- down / status ---------------------------------------------------------
    def down(self, log=print) -> None:
        s = self.state()
        if not s:
            log("the stack is not running")
            return
        tree = self._tree(s)  # flow runs may have started processes in their own sessions
        if s.get("worker_pid"):
            stop_group(s["worker_pid"], signal.SIGINT, 30.0, log, "worker")
        if s.get("server_pid"):
            stop_group(s["server_pid"], signal.SIGINT, 30.0, log, "server")
        _, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:  # descendants that outlived their parents: stopped by their own PIDs
            log(f"  stopping leftover process {p.pid}")
            p.kill()
        psutil.wait_procs(alive, timeout=10)
        left = [p.pid for k in ("worker_pid", "server_pid") if s.get(k) for p in _group(s[k])]
        left += [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if left:
            raise StackError(f"processes left after stopping: {left}")
        self.state_path.unlink(missing_ok=True)
        log("stack stopped; no process left")

    @staticmethod
    def _tree(s: dict) -> list[psutil.Process]:
        """Every live process of the server's and worker's groups, and all their descendants."""
        procs: dict[int, psutil.Process] = {}
        for k in ("worker_pid", "server_pid"):
            if not s.get(k):
                continue
            for p in _group(s[k]):
                procs[p.pid] = p
                try:
                    procs.update({c.pid: c for c in p.children(recursive=True)})
                except psutil.NoSuchProcess:
                    pass
        return list(procs.values())

    def pids(self) -> list[int]:
        """PIDs of every process the stack runs now (flow runs and their children included)."""
        return sorted(p.pid for p in self._tree(self.state() or {}))

    def status(self, log=print) -> dict | None:
        s = self.state()
        if not s:
            log("the stack is not running")
            return None
        up = {k: bool(s.get(k)) and psutil.pid_exists(s[k]) for k in ("server_pid", "worker_pid")}
        healthy = False
        try:
            _http(f"{s['api_url']}/health", timeout=2)
            healthy = True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        log(
            f"Prefect UI: {s['ui_url']}  server {'healthy' if healthy else 'NOT answering'} "
            f"(pid {s['server_pid']})  worker {'running' if up['worker_pid'] else 'NOT running'} "
            f"(pid {s['worker_pid']})"
        )
        return {**s, "healthy": healthy, **{f"{k}_alive": v for k, v in up.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--port", type=int, help=f"server port (default {DEFAULT_PORT}, or a free one if taken)")
    p.add_argument("--home", help="state folder (default runs/.stack)")
    args = p.parse_args(argv)
    stack = Stack(home=args.home, port=args.port)
    try:
        if args.action == "up":
            stack.up()
        elif args.action == "down":
            stack.down()
        else:
            return 0 if stack.status() else 1
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
