"""Weight transports against real server processes: every server ends up with the trainer's
weights bit for bit, labelled with the pushed version; bad input is refused naming the problem."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_core.rollout.client import RolloutClient, RolloutServerError
from areal_core.rollout.launcher import EmbeddedServers
from areal_core.rollout.weight_transport import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    TransportUnsupported,
    named_weights,
)
from tests.test_rollout_server import tiny_qwen2


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("transport")
    tiny_qwen2(21).save_pretrained(root / "v0")
    with EmbeddedServers(str(root / "v0"), 2, log_paths=[str(root / f"s{k}.log") for k in range(2)]) as s:
        yield s, root


async def _server_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    c = RolloutClient(url)
    try:
        return {n: torch.tensor(await c.weights_by_name(n, truncate_size=1 << 20)) for n in names}
    finally:
        await c.aclose()


async def _push(transport, urls: list[str], model, version: int) -> None:
    clients = [RolloutClient(u) for u in urls]
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
    transport = {"tensor": TensorTransport, "distributed": DistributedTransport,
                 "disk": lambda: DiskTransport(str(tmp_path / "w"))}[kind]()
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
        clients = [RolloutClient(u) for u in servers.urls]
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
        c = RolloutClient(url)
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
    assert torch.equal(asyncio.run(_server_weights(url, ["lm_head.weight"]))["lm_head.weight"],
                       before["lm_head.weight"])


def test_a_model_of_another_shape_is_refused_by_name(two_servers):
    servers, _ = two_servers
    other = tiny_qwen2(1)
    with torch.no_grad():
        other.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(65, 64))
    t = TensorTransport()
    with pytest.raises(RolloutServerError, match="embed_tokens.weight has shape"):
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
