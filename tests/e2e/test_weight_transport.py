"""Weight transports against real server processes: every server ends up with the trainer's
weights bit for bit, labelled with the pushed version; bad input is refused naming the problem."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.backends.embedded.launcher import EmbeddedServers
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.weight_transport import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    TransportUnsupported,
    named_weights,
)
from tests.e2e.test_rollout_server import tiny_qwen2


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("transport")
    tiny_qwen2(21).save_pretrained(root / "v0")
    with EmbeddedServers(str(root / "v0"), 2, log_paths=[str(root / f"s{k}.log") for k in range(2)]) as s:
        yield s, root


async def _server_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    c = EmbeddedClient(url)
    try:
        return {n: torch.tensor(await c.weights_by_name(n, truncate_size=1 << 20)) for n in names}
    finally:
        await c.aclose()


async def _push(transport, urls: list[str], model, version: int) -> None:
    clients = [EmbeddedClient(u) for u in urls]
    try:
        await transport.connect(clients)
        transport.stage(model, version)
        with torch.no_grad():  # the trainer goes on: what was staged must not change
            for p in model.parameters():
                p.add_(1.0)
        await transport.push(clients)
        infos = [await c.model_info() for c in clients]
        assert [i.weight_version for i in infos] == [version, version]
    finally:
        for c in clients:
            await c.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor", "distributed", "disk"])
def test_every_server_gets_the_staged_weights_bit_for_bit(two_servers, kind, tmp_path):
    servers, _ = two_servers
    model = tiny_qwen2(100 + len(kind))
    expected = {n: t.clone().flatten() for n, t in named_weights(model).items()}
    transport = {
        "tensor": TensorTransport,
        "distributed": DistributedTransport,
        "disk": lambda: DiskTransport(str(tmp_path / "w")),
    }[kind]()
    version = 10 + len(kind)
    try:
        asyncio.run(_push(transport, servers.urls, model, version))
    finally:
        transport.close()
    for url in servers.urls:
        got = asyncio.run(_server_weights(url, list(expected)))
        for name, want in expected.items():
            assert torch.equal(got[name], want), f"{url}: {name} differs after the {kind} push"


def test_distributed_transport_pushes_again_and_rejoins(two_servers):
    """Several versions through one group, then a new group (what a server restart does)."""
    servers, _ = two_servers
    t = DistributedTransport()
    model = tiny_qwen2(5)

    async def go():
        clients = [EmbeddedClient(u) for u in servers.urls]
        try:
            await t.connect(clients)
            for v in (31, 32):
                with torch.no_grad():
                    next(model.parameters()).add_(0.5)
                t.stage(model, v)
                await t.push(clients)
            await t.resend(clients, 1)  # joins a fresh group, pushes 32 again
            return [(await c.model_info()).weight_version for c in clients]
        finally:
            for c in clients:
                await c.aclose()

    try:
        assert asyncio.run(go()) == [32, 32]
    finally:
        t.close()
    name, want = next(iter(named_weights(model).items()))
    for url in servers.urls:
        assert torch.equal(asyncio.run(_server_weights(url, [name]))[name], want.flatten())


def test_bad_updates_are_refused_and_leave_the_weights(two_servers):
    servers, _ = two_servers
    url = servers.urls[0]
    before = asyncio.run(_server_weights(url, ["lm_head.weight"]))

    async def go():
        c = EmbeddedClient(url)
        try:
            with pytest.raises(RolloutServerError, match="does not exist on this host"):
                from areal_core.rollout.weight_layout import TensorSpec

                await c.update_weights_from_shared_memory("no-such-segment", [TensorSpec("x", "float32", (2,))], 3)
            with pytest.raises(RolloutServerError, match="no weight-update group 'nope'"):
                from areal_core.rollout.weight_layout import TensorSpec

                await c.update_weights_from_distributed([TensorSpec("lm_head.weight", "float32", (64, 64))], "nope", 3)
        finally:
            await c.aclose()

    asyncio.run(go())
    assert torch.equal(
        asyncio.run(_server_weights(url, ["lm_head.weight"]))["lm_head.weight"], before["lm_head.weight"]
    )


def test_a_model_of_another_shape_is_refused_by_name(two_servers):
    servers, _ = two_servers
    other = tiny_qwen2(1)
    with torch.no_grad():
        other.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(65, 64))
    t = TensorTransport()
    with pytest.raises(RolloutServerError, match=r"embed_tokens.weight has shape"):
        try:
            asyncio.run(_push(t, servers.urls[:1] * 2, other, 3))
        finally:
            t.close()


def test_a_server_without_the_transport_is_named_at_connect():
    class _Client:
        url = "http://127.0.0.1:1"

        async def weight_transports(self):
            return ["disk"]

    with pytest.raises(TransportUnsupported, match=r"http://127.0.0.1:1 cannot receive weights by the 'tensor'"):
        asyncio.run(TensorTransport().connect([_Client()]))


def test_distributed_resend_with_a_fixed_master_port(two_servers):
    """A server restart with rollout.weight_transport.master_port set: the new group is made on the
    same port (the store the first group used still holds it), and every server ends at the version."""
    from areal_core.net import free_port

    servers, _ = two_servers
    t = DistributedTransport(master_port=free_port())
    model = tiny_qwen2(6)

    async def go():
        clients = [EmbeddedClient(u) for u in servers.urls]
        try:
            await t.connect(clients)
            t.stage(model, 41)
            await t.push(clients)
            with torch.no_grad():
                next(model.parameters()).add_(0.25)
            t.stage(model, 42)
            await t.resend(clients, 0)  # a new group on the same port, then version 42 to everyone
            await t.resend(clients, 1)  # and once more
            return [(await c.model_info()).weight_version for c in clients]
        finally:
            for c in clients:
                await c.aclose()

    try:
        assert asyncio.run(go()) == [42, 42]
    finally:
        t.close()
    name, want = next(iter(named_weights(model).items()))
    for url in servers.urls:
        assert torch.equal(asyncio.run(_server_weights(url, [name]))[name], want.flatten())


class _SlowStage:
    """Stages the way the trainer does, one tensor at a time with a pause after each (a large model
    takes seconds to copy); ``started`` is set once the first tensor of the new version is in."""

    def __init__(self, transport, pause_s: float = 0.05):
        import threading

        self.t, self.pause_s, self.started = transport, pause_s, threading.Event()
        self._real = type(transport)._stage

    def __call__(self, named, version):
        import time

        for name, tensor in named.items():  # (the buffer exists: a version was staged before)
            self._real(self.t, {name: tensor}, version)
            self.started.set()
            time.sleep(self.pause_s)


@pytest.mark.parametrize("kind", ["tensor", "distributed"])
def test_a_recovering_server_never_loads_a_mix_of_two_versions(two_servers, kind):
    """A server brought back while the trainer stages the next version: what it loads is one staged
    version, whole, labelled as that version; after the next push the two servers hold identical weights."""
    servers, _ = two_servers
    transport = TensorTransport() if kind == "tensor" else DistributedTransport()
    old, new = tiny_qwen2(70), tiny_qwen2(71)
    want = {50: named_weights(old), 51: named_weights(new)}
    names = list(want[50])

    async def go():
        clients = [EmbeddedClient(u) for u in servers.urls]
        try:
            await transport.connect(clients)
            transport.stage(old, 50)
            await transport.push(clients)
            slow = _SlowStage(transport)
            transport._stage = slow  # (an instance attribute: this transport only)
            staging = asyncio.ensure_future(asyncio.to_thread(transport.stage, new, 51))
            await asyncio.to_thread(slow.started.wait, 10)
            await transport.resend(clients, 1)  # server 1 came back while version 51 is being staged
            label = (await clients[1].model_info()).weight_version
            got = await _server_weights(servers.urls[1], names)
            await staging
            await transport.push(clients)  # version 51 to every server, as the controller does next
            after = [await _server_weights(u, names) for u in servers.urls]
            return label, got, after
        finally:
            for c in clients:
                await c.aclose()

    try:
        label, got, after = asyncio.run(go())
    finally:
        transport.close()
    assert label in want
    mixed = [n for n in names if not torch.equal(got[n], want[label][n].flatten())]
    assert not mixed, (
        f"labelled {label}, but {len(mixed)} of {len(names)} tensors are not version {label}'s: {mixed[:3]}"
    )
    for n in names:
        assert torch.equal(after[0][n], after[1][n]) and torch.equal(after[0][n], want[51][n].flatten())


@pytest.fixture(scope="module")
def bf16_servers(tmp_path_factory):
    from areal_core.rollout.config import EngineConfig

    root = tmp_path_factory.mktemp("bf16")
    tiny_qwen2(31).save_pretrained(root / "v0")
    logs = [str(root / f"s{k}.log") for k in range(2)]
    with EmbeddedServers(str(root / "v0"), 2, engine=EngineConfig(dtype="bfloat16"), log_paths=logs) as s:
        yield s


@pytest.mark.parametrize("kind", ["tensor", "distributed", "disk"])
def test_a_float32_trainer_reaches_bfloat16_servers_through_every_transport(bf16_servers, tmp_path, kind):
    """rollout.dtype bfloat16 beside a float32 trainer: each transport brings the servers the
    trainer's weights rounded to bfloat16 (the tensors travel cast, at half the bytes; a folder is
    cast as the server loads it); sent uncast, the same update is refused naming the dtypes."""
    from areal_core.rollout.config import DiskTransportConfig, DistributedTransportConfig, TensorTransportConfig
    from areal_core.rollout.weight_transport import make_transport

    model = tiny_qwen2(32 + len(kind))
    want = {n: t.to(torch.bfloat16).float().flatten() for n, t in named_weights(model).items()}
    cfg = {"tensor": TensorTransportConfig, "distributed": DistributedTransportConfig, "disk": DiskTransportConfig}
    urls = bf16_servers.urls
    if kind == "tensor":  # the trainer's own dtype is refused by name
        plain = make_transport(cfg[kind](), str(tmp_path))
        with pytest.raises(RolloutServerError, match="arrives as float32, the server's model is bfloat16"):
            asyncio.run(_push(plain, urls, tiny_qwen2(32), 1))
        plain.close()
    transport = make_transport(cfg[kind](), str(tmp_path), dtype="bfloat16")
    try:
        asyncio.run(_push(transport, urls, model, 10 + len(kind)))
        if kind != "disk":
            assert transport.staged_bytes == sum(t.numel() * 2 for t in want.values())
    finally:
        transport.close()
    got = [asyncio.run(_server_weights(url, list(want))) for url in urls]
    for name, w in want.items():
        for g in got:
            assert torch.equal(g[name], w), f"{name}: a bfloat16 server does not hold the rounded weights after {kind}"


class _GatedClient(EmbeddedClient):
    """A server whose second health check answers once ``gate`` is set (the others at once): a join
    waits there, after the server was seen to answer."""

    def __init__(self, url: str, gate: asyncio.Event, timeout_s: float = 60.0):
        super().__init__(url, timeout_s)
        self.gate, self.checks, self.waiting = gate, 0, asyncio.Event()

    async def health(self) -> bool:
        self.checks += 1
        if self.checks == 2:
            self.waiting.set()
            await self.gate.wait()
        return await super().health()


@pytest.mark.parametrize("order", ["push during the join", "push after the join"])
def test_a_push_while_a_server_joins_an_elastic_pool_reaches_every_member(two_servers, order):
    """An elastic pool of server 0 under the distributed transport; server 1 joins while the trainer
    pushes the next version. The push reaches the members the transport has made part of its group
    (never the joiner before it joined the group), and both servers end at the pushed version."""
    from areal_core.controller.recovery import ServerRecovery
    from areal_core.rollout.pool import RolloutPool

    servers, root = two_servers
    transport = DistributedTransport()
    recovery = ServerRecovery(transport, 60.0, None, str(root / "v0"), 0, elastic=True)
    model = tiny_qwen2(81)

    async def go():
        gate = asyncio.Event()
        pool = RolloutPool(servers.urls[:1], make_client=EmbeddedClient)
        recovery.bind(pool, None)
        joiner = _GatedClient(servers.urls[1], gate)
        try:
            await recovery.connect()
            transport.stage(model, 60)
            await recovery.push(60)
            with torch.no_grad():
                next(model.parameters()).add_(0.5)
            transport.stage(model, 61)
            joining = asyncio.ensure_future(recovery.join(joiner))
            await joiner.waiting.wait()  # the join has seen the server answer and waits on its next check
            if order == "push during the join":
                await recovery.push(61)
                gate.set()
                joined = await joining
            else:
                gate.set()
                joined = await joining
                await recovery.push(61)
            return joined, [(await c.model_info()).weight_version for c in pool.live()]
        finally:
            for c in pool.clients:
                await c.aclose()

    try:
        joined, versions = asyncio.run(go())
    finally:
        transport.close()
    assert joined and versions == [61, 61]
    name, want = next(iter(named_weights(model).items()))
    for url in servers.urls:
        assert torch.equal(asyncio.run(_server_weights(url, [name]))[name], want.flatten())


def test_a_member_lost_while_the_group_forms_ends_the_wait_at_once(two_servers):
    """A server killed between the transport's check and its joining of a new group: ``connect``
    raises its error (server down, named) at once, instead of waiting with the group's other
    members for it until the group's timeout (300 s here, as by default); the survivor, whose
    request to join that group is still pending, joins the next group and gets the weights."""
    from areal_core.rollout.backends.embedded.launcher import start_server

    servers, root = two_servers
    doomed = start_server(str(root / "v0"), log_path=str(root / "doomed.log"))
    t = DistributedTransport(timeout_s=300.0)
    model = tiny_qwen2(7)

    async def go():
        survivor, dying = EmbeddedClient(servers.urls[0]), EmbeddedClient(doomed.url)
        join = dying.init_weights_update_group

        async def killed_first(*args):
            doomed._signal(9)
            await asyncio.to_thread(doomed.stop)  # (returns once it is gone)
            return await join(*args)

        dying.init_weights_update_group = killed_first
        try:
            with pytest.raises(RolloutServerError) as lost:
                await asyncio.wait_for(t.connect([survivor, dying]), timeout=120)
            await t.members_changed([survivor])  # the pool without it: a group of one
            t.stage(model, 71)
            await asyncio.wait_for(t.push([survivor]), timeout=120)
            return lost.value, (await survivor.model_info()).weight_version
        finally:
            await survivor.aclose()
            await dying.aclose()

    try:
        lost, version = asyncio.run(go())
    finally:
        t.close()
        doomed.stop()
    assert lost.url == doomed.url and lost.server_down, lost
    assert version == 71
    name, want = next(iter(named_weights(model).items()))
    assert torch.equal(asyncio.run(_server_weights(servers.urls[0], [name]))[name], want.flatten())
