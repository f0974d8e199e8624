"""A Slurm cluster for tests, made and removed by the test: ``munged`` with a key made here, one
``slurmctld`` and N ``slurmd`` nodes, each node in a Linux network namespace of its own with its own
address (``tests/netns.py``: the controller host ``ctl`` at 10.231.0.1 holds the bridge, nodes ``n1``,
``n2``, ... at .2, .3, ...), one CPU-only partition ``cpu`` of them all, and a folder every node reads
(they share this machine's filesystem) as the cluster's storage.

Every daemon is started in its namespace by :class:`netns.Host` and stopped by PID when the block
ends; jobs left running are cancelled first. The Slurm commands (``sbatch``, ``squeue``, ...) reach the
controller only from inside the namespaces: :meth:`SlurmCluster.run` runs one on the controller host
(the cluster's login node), with ``SLURM_CONF`` pointing at the cluster's ``slurm.conf``.

Needs root, iproute2 and Debian's ``slurm-wlm`` and ``munge`` (``make slurm``): :func:`unavailable`
says in one line what is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from netns import Host, private_hosts
from netns import unavailable as netns_unavailable

DAEMONS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm"}
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "cpu"
URGENT = "urgent"  # with preemption=True: a partition whose jobs preempt (requeue) those of `cpu`


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here, in one line (None: it can)."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (its daemons and network namespaces)"
    missing = sorted(
        {pkg for d, pkg in DAEMONS.items() if _which(d) is None}
        | {"slurm-client" for c in CLIENTS if _which(c) is None}
    )
    if missing:
        return f"not installed: {', '.join(missing)} (make slurm installs them)"
    return netns_unavailable()


@dataclass
class SlurmCluster:
    root: Path  # the cluster's files: slurm.conf, keys, state, logs
    shared: Path  # the folder every node reads: run folders go here
    conf: Path
    ctl: Host
    nodes: dict[str, Host]  # node name -> its host

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm command (or a process that runs one) needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` as run on the controller host (the login node)."""
        return self.ctl.command(cmd)

    def run(self, cmd: list[str], timeout_s: float = 60.0, check: bool = True) -> str:
        proc = subprocess.run(
            self.command(cmd), capture_output=True, text=True, env={**os.environ, **self.env}, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def queue(self) -> list[str]:
        """The jobs ``squeue`` lists (array tasks one by one)."""
        return self.run(["squeue", "-h", "-r", "-o", "%i"]).split()

    def node_of(self, address: str) -> str:
        return next(name for name, h in self.nodes.items() if h.address == address)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until every node is up and idle (``sinfo``)."""
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            up = dict(line.split() for line in states.splitlines() if len(line.split()) == 2)
            if len(up) == len(self.nodes) and all(s == "idle" for s in up.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s:.0f} s: {states.strip()!r}; logs in {self.root}/log")


def _conf(root: Path, ctl: Host, nodes: dict[str, Host], cpus: int, munge_socket: Path, preemption: bool) -> str:
    node_lines = [
        f"NodeName={n} NodeAddr={h.address} CPUs={cpus} RealMemory=4000 State=UNKNOWN" for n, h in nodes.items()
    ]
    partitions = [f"PartitionName={PARTITION} Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP"]
    if preemption:  # a job of the urgent partition takes the CPUs it needs from jobs of `cpu`, which are requeued
        partitions = [
            partitions[0] + " PriorityTier=1",
            f"PartitionName={URGENT} Nodes={','.join(nodes)} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
        ]
        node_lines = ["PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE", *node_lines]
    return "\n".join(
        [
            "ClusterName=aftest",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({ctl.address})",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={munge_socket},cred_expire=10",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/run/slurmctld.pid",
            f"SlurmdPidFile={root}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1",  # a requeued job starts within seconds once eligible
            "SlurmdParameters=config_overrides",  # the nodes' CPUs are the config's, not the machine's 2
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MinJobAge=600",  # finished jobs stay in scontrol's view for the tests' checks
            "KillWait=10",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "PropagateResourceLimits=NONE",
            *node_lines,
            *partitions,
            "",
        ]
    )


def _munge_key(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(1024))


def _wait_for(path: Path, what: str, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what} did not start in {timeout_s:.0f} s: {tail}")
        time.sleep(0.2)


@contextlib.contextmanager
def slurm_cluster(root: Path, n_nodes: int = 3, cpus: int = 4, preemption: bool = False) -> Iterator[SlurmCluster]:
    """Start the cluster under ``root`` (see the module docstring); stop it, by PID, at the end.
    ``preemption``: a second partition, ``urgent``, whose jobs preempt those of ``cpu`` (Slurm requeues
    them: ``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``)."""
    root = Path(root)
    for sub in ("munge", "state", "spool", "run", "log", "shared"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    names = [f"n{k}" for k in range(1, n_nodes + 1)]
    with private_hosts(["ctl", *names]) as hosts:
        ctl, nodes = hosts["ctl"], {n: hosts[n] for n in names}
        munge = root / "munge"
        _munge_key(munge / "munge.key")
        sock = munge / "munge.socket"
        ctl.start(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={munge / 'munge.key'}",
                f"--socket={sock}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={root / 'log' / 'munged.log'}",
                "--num-threads=2",
            ],
            root / "log" / "munged.out",
        )
        _wait_for(sock, "munged", root / "log" / "munged.log")
        conf = root / "slurm.conf"
        conf.write_text(_conf(root, ctl, nodes, cpus, sock, preemption))
        cluster = SlurmCluster(root, root / "shared", conf, ctl, nodes)
        env = cluster.env
        ctl.start([_which("slurmctld"), "-D", "-i", "-f", str(conf)], root / "log" / "slurmctld.out", env)
        for name, host in nodes.items():
            (root / "spool" / name).mkdir(exist_ok=True)
            host.start(  # (slurmd needs /sys/fs/cgroup, which `ip netns exec`'s /sys lacks)
                [_which("slurmd"), "-D", "-N", name, "-f", str(conf)], root / "log" / f"slurmd-{name}.out", env, True
            )
        try:
            cluster.wait_idle()
            yield cluster
        finally:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                cluster.run(
                    ["scancel", "--quiet", "--user=root"], timeout_s=30
                )  # (every job: the cluster is the test's)
                deadline = time.monotonic() + 30
                while cluster.queue() and time.monotonic() < deadline:
                    time.sleep(0.5)
            # (private_hosts stops every daemon by PID, nodes first, then removes the namespaces)
