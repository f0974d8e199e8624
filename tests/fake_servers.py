"""Fake rollout servers and transport for controller tests where the server is not what is tested:
the controller is given ``Servers(urls, make_client=...)`` that builds a :class:`ScriptedServer`
per URL, so no server process starts."""

from __future__ import annotations

import asyncio

from areal_core.rollout.backend import Generation, ServerInfo
from areal_core.rollout.weight_transport import WeightTransport


class RecordingTransport(WeightTransport):
    """Moves nothing; records which servers each push reached and sets their version."""

    def __init__(self):
        self.pushed_to: list[list[str]] = []

    async def connect(self, clients) -> None:
        self.connected = [c.url for c in clients]

    def _stage(self, weights, version: int) -> None:
        pass

    def stage(self, model, version: int) -> None:
        self.staged_version = version

    async def _push(self, clients, version: int) -> None:
        self.pushed_to.append([c.url for c in clients])
        for c in clients:
            c.version = version


class ScriptedServer:
    """A scripted rollout client (``make_client``): answers each prompt with its first token, then
    EOS (token 3), tagged with the version it holds; records every prompt it was asked."""

    def __init__(self, url: str, timeout_s: float = 0):
        self.url, self.version, self.prompts = url, 0, []

    async def generate_batch(self, input_ids, sampling, rids=None):
        return [await self.generate(ids, sampling) for ids in input_ids]

    async def generate(self, input_ids, sampling, rid=None):
        self.prompts.append(list(input_ids))
        await asyncio.sleep(0.001)
        return Generation(
            output_ids=[input_ids[0], 3], logprobs=[-0.1, -0.1], versions=[self.version] * 2, finish_reason="stop"
        )

    async def health(self):
        return True

    async def info(self):
        return ServerInfo(weight_version=self.version, running=0, waiting=0, paused=False)

    async def partial_outputs(self):
        return {}

    async def abort_request(self, rid):
        pass

    async def aclose(self):
        pass


def scripted_servers() -> tuple[dict, object]:
    """(the servers made so far, by URL; a ``make_client`` that makes and records them)."""
    made: dict[str, ScriptedServer] = {}

    def make_client(url, timeout_s=0):
        made[url] = ScriptedServer(url)
        return made[url]

    return made, make_client
