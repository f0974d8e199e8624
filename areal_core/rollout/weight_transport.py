"""How new weights reach the rollout servers: one class per transport, chosen by config.

Checkpoints are a separate concern (storage/): a transport only moves the current weights.

    stage(model, version)      the trainer's thread, between two steps: take a consistent copy
    await push(clients)        the controller's loop: every server serves the staged version on return
    await resend(clients, i)   server i came back (restarted) or joined: give it the staged version
    await members_changed(clients)  a server left or joined an elastic pool: ``clients`` are the servers now

The caller stages version v+1 only after the push of v has returned, so a transport keeps one
send buffer, and ``staged_version`` labels what it holds. A resend, though, comes whenever a
server is brought back, also while the trainer stages the next version: so staging and sending
take turns on the buffer (``_buffer_lock``), and a send reads one version whole, labelled as
what it is. ``connect`` runs once before the first push; it fails, naming the server and the
transport, when a server cannot receive weights this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from areal_core.aio import settle_threadsafe
from areal_core.net import free_port
from areal_core.rollout.backend import WeightClient
from areal_core.rollout.client import RolloutServerError, run_all
from areal_core.rollout.weight_layout import flat_layout, make_process_group, views_of
from areal_core.trainer.published import published


class TransportUnsupported(RuntimeError):
    """A rollout server cannot receive weights by the configured transport."""


def named_weights(
    model: torch.nn.Module, adapters: bool = True, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """What ``model`` sends to the servers, by name. A full model: its parameters, a tied one once
    (what the servers' models expect). A LoRA model: with ``adapters`` (servers running our engine,
    which merges them) only the adapters, in float32 whatever the servers run; without (servers that
    load whole named weights: SGLang, vLLM through disk) the full weights with the adapters merged
    (``trainer/published.py``). Whole weights are cast to ``dtype``, the servers' (None: as they are)."""
    return published(model).pushed(model, adapters, dtype)


class WeightTransport(ABC):
    kind: str
    staged_version: int | None = None
    adapters: bool = True  # a LoRA model sends adapters (False: merged full weights; see named_weights)
    dtype: torch.dtype | None = None  # the servers' (rollout.dtype): whole weights are cast to it (None: as they are)
    staged_bytes: int = 0  # bytes of the staged version's tensors: what each server receives
    last_push_s: float | None = None  # wall time of the last push that returned

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._buffer_lock = threading.Lock()  # staging (trainer thread) and sending (the loop) take turns
        return self

    @contextlib.asynccontextmanager
    async def _buffer(self):
        """Hold the send buffer while a send reads it; waits (without blocking the loop) for a staging
        in progress to finish."""
        while not self._buffer_lock.acquire(blocking=False):  # noqa: ASYNC110 - a thread's lock, no Event to await
            await asyncio.sleep(0.005)
        try:
            yield
        finally:
            self._buffer_lock.release()

    async def connect(self, clients: list[WeightClient]) -> None:
        offers = await asyncio.gather(*(c.weight_transports() for c in clients))
        for c, offered in zip(clients, offers):
            if self.kind not in offered:
                raise TransportUnsupported(
                    f"rollout server {c.url} cannot receive weights by the '{self.kind}' transport "
                    f"(it offers: {', '.join(offered)}); set rollout.weight_transport to one of those"
                )

    def stage(self, model: torch.nn.Module, version: int) -> None:
        with self._buffer_lock:  # a resend under way finishes reading the previous version first
            if self.kind == "disk":
                self._stage(model, version)  # (sets staged_bytes: the folder's size)
            else:
                named = named_weights(model, self.adapters, self.dtype)
                self._stage(named, version)
                self.staged_bytes = sum(t.nbytes for t in named.values())
            self.staged_version = version

    async def push(self, clients: list[WeightClient]) -> None:
        async with self._buffer():
            if self.staged_version is None:
                raise RuntimeError(f"{self.kind} transport: push() before anything was staged")
            t0 = time.perf_counter()
            await self._push(clients, self.staged_version)
            self.last_push_s = time.perf_counter() - t0

    async def resend(self, clients: list[WeightClient], i: int) -> None:
        """Server ``i`` came back: give it the staged version (the one whole version in the buffer,
        which may be newer than what the others serve; the next push brings them to it)."""
        async with self._buffer():
            if self.staged_version is None:
                raise RuntimeError(f"{self.kind} transport: resend() before anything was staged")
            await self._resend(clients, i, self.staged_version)

    async def _resend(self, clients: list[WeightClient], i: int, version: int) -> None:
        await self._push([clients[i]], version)

    async def members_changed(self, clients: list[WeightClient]) -> None:  # noqa: B027 - optional
        """The pool's servers are now ``clients`` (one left, or joined and was resent the weights):
        nothing to do for a transport that sends to each server on its own."""

    @abstractmethod
    def _stage(self, weights, version: int) -> None: ...

    @abstractmethod
    async def _push(self, clients: list[WeightClient], version: int) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional: only a transport that holds resources overrides it
        pass


class DiskTransport(WeightTransport):
    """A Hugging Face folder per version under ``folder`` (the last two kept), loaded by each server
    through ``/update_weights_from_disk``: for servers that can only load from a path or URL. A LoRA
    model is saved merged (whole named weights: what such servers load)."""

    kind = "disk"
    adapters = False

    def __init__(self, folder: str, keep: int = 2):
        self.folder, self.keep = folder, keep
        self._staged: list[tuple[int, str]] = []

    def _stage(self, model: torch.nn.Module, version: int) -> None:
        dest = os.path.join(self.folder, f"v{version}")
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        state, layout = published(model).loadable(model)  # (adapters: the base's layout, the merged values)
        with layout as m:
            m.save_pretrained(tmp, state_dict=state)
        self.staged_bytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(tmp) for n in ns)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)  # a server never sees a half-written folder
        self._staged.append((version, dest))
        while len(self._staged) > self.keep:
            shutil.rmtree(self._staged.pop(0)[1], ignore_errors=True)

    def _path(self, version: int) -> str:
        for v, path in self._staged:
            if v == version:
                return path
        raise RuntimeError(f"disk transport: version {version} was not staged (staged: {[v for v, _ in self._staged]})")

    async def _push(self, clients: list[WeightClient], version: int) -> None:
        path = self._path(version)
        await run_all(c.update_weights_from_disk(path, version) for c in clients)


class TensorTransport(WeightTransport):
    """Servers on this host read the weights from one shared-memory segment (no file, one copy
    in, one copy out): ``/update_weights_from_tensor``."""

    kind = "tensor"

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._specs = None

    def _stage(self, named: dict[str, torch.Tensor], version: int) -> None:
        if self._shm is None:
            self._specs, size = flat_layout(named)
            self._shm = shared_memory.SharedMemory(
                name=f"areal-w-{os.getpid()}-{uuid.uuid4().hex[:8]}", create=True, size=size
            )
        views = views_of(self._shm.buf, self._specs, "the tensor transport's segment")
        with torch.no_grad():
            for name, t in named.items():
                views[name].copy_(t)

    async def _push(self, clients: list[WeightClient], version: int) -> None:
        await run_all(c.update_weights_from_shared_memory(self._shm.name, self._specs, version) for c in clients)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


class _Collective:
    """A blocking collective call (a group's rendezvous, a broadcast) in a daemon thread of its own.

    Once a member of the group has failed, the call cannot complete: it blocks until the group's
    timeout (minutes). Whoever waits for it gives up (``until_a_member_fails``); the thread is left
    to that timeout, and being a daemon it holds up neither the event loop's shutdown nor the
    process's exit (a thread of the loop's executor would hold up both)."""

    def __init__(self, fn, *args):
        self.done = threading.Event()  # set when ``fn`` has returned or raised, before ``result`` resolves
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                value, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, if one is still waiting
                value, error = None, e
            self.done.set()
            settle_threadsafe(self.result, value, error)

        threading.Thread(target=run, name=f"weights-{getattr(fn, '__name__', 'collective')}", daemon=True).start()


# how long the servers' answers are awaited after the trainer's side of a collective failed: a
# server that died answers at once (connection refused or reset), one still waiting for the
# collective never does before the group's timeout
NAME_THE_FAILED_S = 10.0


async def until_a_member_fails(collective: _Collective, calls) -> object:
    """The collective's result once it and every server's side of it (``calls``) returned; the first
    server's error as soon as one fails: the group then cannot complete, and its other members
    would wait for the failed one until the group's timeout. (The collective is left to that
    timeout; a server lost raises ``RolloutServerError`` with ``server_down``, and the next push
    goes to a new group of the servers left, ``members_changed``.) When the collective fails first
    (gloo's "connection closed" when a peer died), the servers' answers are awaited a little longer
    (``NAME_THE_FAILED_S``), for the one that names the member lost; then its own error is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    pending, deadline = {collective.result, *tasks}, None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in tasks if t in done and not t.cancelled() and t.exception()]
        if deadline is None and collective.result.done() and collective.result.exception():
            deadline = time.monotonic() + NAME_THE_FAILED_S
        if failed or (deadline is not None and time.monotonic() >= deadline):
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            lost = [e for e in failed if isinstance(e, RolloutServerError) and e.server_down]
            raise (lost or failed or [collective.result.exception()])[0]
    return collective.result.result()


class DistributedTransport(WeightTransport):
    """A torch.distributed broadcast from the trainer (rank 0) to every server (ranks 1..n), through
    SGLang's ``/init_weights_update_group`` and ``/update_weights_from_distributed``; gloo on CPU,
    NCCL on GPU. A server that restarts makes everyone join a new group: a new name under the same
    rendezvous store (one ``TCPStore`` on one port for the transport's life, so a fixed
    ``master_port`` serves every generation of the group). A member that fails while its group
    forms or a broadcast runs ends the wait at once (``until_a_member_fails``)."""

    kind = "distributed"

    def __init__(
        self,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout_s: float = 300.0,
    ):
        self.backend, self.address, self.port, self.timeout_s = backend, master_address, master_port, timeout_s
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._group = ""
        self._generation = 0
        self._send: dict[str, torch.Tensor] | None = None
        self._specs = None
        self._sending: _Collective | None = None  # the last broadcast

    async def connect(self, clients: list[WeightClient]) -> None:
        await super().connect(clients)
        self._generation += 1
        self._group = f"areal-weights-{os.getpid()}-{self._generation}"
        world, timeout = len(clients) + 1, datetime.timedelta(seconds=self.timeout_s)
        if self._store is None:  # made once: a second store on a port the first holds fails (EADDRINUSE)
            self._store = dist.TCPStore(
                self.address,
                self.port or free_port(self.address),
                world,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
            )
        port = self._store.port
        self._pg = None  # (until the new group has formed, no push goes to the old one under the new name)
        # each generation meets through a connection to the store of its own: a rendezvous left
        # waiting for a member that was lost holds its connection until the group's timeout
        own = dist.TCPStore(self.address, port, None, is_master=False, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(self._group, own)
        join = _Collective(make_process_group, self.backend, store, 0, world, self.timeout_s, self.address)
        self._pg = await until_a_member_fails(
            join,
            [
                c.init_weights_update_group(self.address, port, k + 1, world, self._group, self.backend)
                for k, c in enumerate(clients)
            ],
        )

    def _stage(self, named: dict[str, torch.Tensor], version: int) -> None:
        device = "cuda" if self.backend == "nccl" else "cpu"
        if self._sending is not None and not self._sending.done.is_set():
            # a broadcast given up on (a member failed) may still read its buffers until the group's
            # timeout: it keeps them, and this version goes to new ones
            self._send = None
        if self._send is None:
            self._send = {n: torch.empty_like(t, device=device) for n, t in named.items()}
            self._specs = flat_layout(named)[0]
        with torch.no_grad():
            for n, t in named.items():
                self._send[n].copy_(t)

    def _broadcast(self, pg: dist.ProcessGroup, send: dict[str, torch.Tensor]) -> None:
        for s in self._specs:
            pg.broadcast(send[s.name], 0).wait()

    async def _push(self, clients: list[WeightClient], version: int) -> None:
        if self._pg is None:
            raise RuntimeError("distributed transport: connect() comes before push()")
        self._sending = _Collective(self._broadcast, self._pg, self._send)
        await until_a_member_fails(
            self._sending, [c.update_weights_from_distributed(self._specs, self._group, version) for c in clients]
        )

    async def _resend(self, clients: list[WeightClient], i: int, version: int) -> None:
        await self.connect(clients)  # the group has a fixed membership: everyone joins a new one
        await self._push(clients, version)

    async def members_changed(self, clients: list[WeightClient]) -> None:
        if clients:
            await self.connect(clients)  # a new group of the servers there are now

    def close(self) -> None:
        self._pg = None
        self._store = None


ADAPTER_BACKENDS = ("embedded", "external")  # rollout backends running our engine, which merges adapters


def make_transport(cfg, work_dir: str, adapters: bool = True, dtype: str | None = None) -> WeightTransport:
    """The transport a ``rollout.weight_transport`` config section names. ``adapters``: whether
    the servers take LoRA adapters (``ADAPTER_BACKENDS``); else a LoRA model sends merged weights.
    ``dtype``: what the servers compute in; weights are cast to it before they travel (a folder is
    written as the trainer holds it: the servers cast what they load)."""
    if cfg.kind == "disk":
        return DiskTransport(os.path.join(work_dir, "weights"))
    if cfg.kind == "tensor":
        t = TensorTransport()
    elif cfg.kind == "distributed":
        t = DistributedTransport(cfg.backend, cfg.master_address, cfg.master_port)
    else:
        raise ValueError(f"unknown weight transport {cfg.kind!r}")
    t.adapters, t.dtype = adapters, getattr(torch, dtype) if dtype else None
    return t
