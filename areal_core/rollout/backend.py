"""What the controller needs from a rollout backend, in domain types (no wire formats).

A backend (the embedded engine, vLLM, SGLang, ...) is one class that starts or finds its
servers (:class:`RolloutBackend`) and one client per server that speaks that server's HTTP
API and answers with :class:`Generation` (:class:`RolloutClient`). The controller, the run
and the weight transports see only these; what a server's JSON looks like is the client's
business alone.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]

# How a server takes a weight update while it generates (``rollout.weight_update``; the embedded
# engine's docstring says what each does). Declared once: the config, the wire, every backend, the
# simulator and the command line use it.
WeightUpdateMode = Literal["reprefill", "keep_kv", "drain"]
WEIGHT_UPDATE_MODES: tuple[WeightUpdateMode, ...] = typing.get_args(WeightUpdateMode)
DEFAULT_WEIGHT_UPDATE: WeightUpdateMode = "reprefill"  # AReaL's interruptible generation


def weight_update_mode(value: str) -> WeightUpdateMode:
    """``value`` as a :data:`WeightUpdateMode`; anything else is a ValueError naming the modes."""
    if value not in WEIGHT_UPDATE_MODES:
        raise ValueError(f"weight_update: must be one of {', '.join(WEIGHT_UPDATE_MODES)}, got {value!r}")
    return typing.cast(WeightUpdateMode, value)


@dataclass(frozen=True)
class Generation:
    """One request's new tokens: ids, the behaviour logprob of each (of the distribution it was
    sampled from), the weight version that sampled each, and why generation ended
    (``abort``: cut short by a pause or an abort; continue it from ``prompt + output_ids``)."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"a generation needs one logprob and one version per token: {len(self.output_ids)} "
                f"tokens, {len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )


@dataclass(frozen=True)
class Sampling:
    """Sampling for one request (SGLang's names). ``seed``: the request's own random stream."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class ServerInfo:
    weight_version: int
    running: int  # requests being decoded
    waiting: int  # requests queued
    paused: bool
    busy_s: float | None = None  # seconds spent generating since start (None: the server does not say)
    reprefilled_tokens: int | None = None  # positions prefilled again after weight updates, since start
    kv_budget_tokens: int | None = None  # KV positions one request may reserve at most (None: no limit said)


def server_infos(urls: Sequence[str], make_client) -> list[ServerInfo]:
    """What each server at ``urls`` reports (``make_client``: the backend's client), asked at once."""
    import asyncio

    async def ask() -> list[ServerInfo]:
        clients = [make_client(u) for u in urls]
        try:
            return list(await asyncio.gather(*(c.info() for c in clients)))
        finally:
            for c in clients:
                await c.aclose()

    return asyncio.run(ask())


class RolloutClient(Protocol):
    """One server. Errors: :class:`areal_core.rollout.client.RolloutServerError` (``server_down``
    tells a lost server, whose requests the caller resubmits, from a refused request)."""

    url: str

    async def generate(self, input_ids: Sequence[int], sampling: Sampling, rid: str) -> Generation: ...
    async def generate_batch(
        self, input_ids: Sequence[Sequence[int]], sampling: Sequence[Sampling], rids: Sequence[str]
    ) -> list[Generation]: ...
    async def abort_request(self, rid: str) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights_from_disk(self, model_path: str, version: int) -> None: ...
    async def info(self) -> ServerInfo: ...
    async def weight_transports(self) -> list[str]: ...  # of disk, tensor, distributed
    async def partial_outputs(self) -> dict[str, Generation]:
        """What each unfinished request generated so far, by rid (a resumed run continues those
        answers instead of starting them again); {} from servers that cannot tell."""
        ...

    async def health(self) -> bool: ...
    async def aclose(self) -> None: ...


class WeightClient(RolloutClient, Protocol):
    """A client whose server takes weights by more than a folder: from shared memory on its host, or
    broadcast over a process group (``weight_transports`` says which); what the weight transports use."""

    async def update_weights_from_shared_memory(self, shm_name: str, specs, version: int) -> None: ...
    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...
    async def update_weights_from_distributed(self, specs, group_name: str, version: int) -> None: ...


class RolloutBackend(Protocol):
    """Starts (or finds) a run's servers and makes a client for each. ``launch`` leaves every
    server serving ``model_path`` as ``version``; leaving its context stops what it started."""

    name: str
    restartable: bool  # whether ``restart`` can bring back a server that died
    # its servers may run on other hosts: ``launch`` gets the version's URL in the checkpoint store
    # (s3://...: each server reads it from there), else a copy on this host's disk
    reads_store_urls: bool
    api_key: str | None  # what its clients send as a bearer token (None: servers that take none); auth.py

    def launch(self, model_path: str, version: int) -> contextlib.AbstractContextManager[list[str]]: ...

    def restart(self, index: int, model_path: str, version: int) -> None:
        """Start server ``index`` again (same URL) from ``model_path`` as ``version`` (blocking)."""
        ...

    def client(self, url: str, timeout_s: float) -> RolloutClient: ...


def versions_from_spans(spans: Sequence[dict], n_tokens: int) -> list[int]:
    """Per-token weight versions from SGLang / vLLM ``weight_versions`` spans
    (``{"version", "start", "end"}``, ``end`` exclusive, over the output tokens), which must
    cover ``0..n_tokens`` without gaps or overlaps."""
    out: list[int] = []
    for k, span in enumerate(spans):
        try:
            version, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weight_versions[{k}] must be {{version, start, end}} integers, got {span!r}") from e
        if start != len(out) or end < start:
            raise ValueError(
                f"weight_versions[{k}] = {span!r} does not continue the spans before it (next token {len(out)})"
            )
        out += [version] * (end - start)
    if len(out) != n_tokens:
        raise ValueError(f"weight_versions cover {len(out)} tokens, the output has {n_tokens}")
    return out
