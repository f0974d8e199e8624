"""Client of the embedded rollout server: the only code that knows its HTTP paths and JSON.

It answers in the domain types of ``rollout/backend.py`` (:class:`Generation`), as every backend's
client does; the wire types of ``rollout/protocol.py`` stay in here and in the server. A request's
own seed goes in its sampling params, under SGLang's name ``sampling_seed``. The HTTP plumbing
(session, API key, retries, errors) is ``rollout/client.py``'s ``HTTPClient``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pydantic

from areal_core.rollout.backend import Generation, Sampling, ServerInfo
from areal_core.rollout.client import HEALTH, HTTPClient, RolloutServerError, wait_healthy
from areal_core.rollout.protocol import (
    AbortRequest,
    GenerateBatchRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsGroupRequest,
    ModelInfo,
    RequestsSnapshot,
    SamplingParams,
    SharedTensor,
    StatusResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromSharedMemoryRequest,
    UpdateWeightsRequest,
    WeightsByNameRequest,
)

GENERATE = "/generate"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
UPDATE_WEIGHTS = "/update_weights_from_disk"
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"
INIT_GROUP = "/init_weights_update_group"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"
ABORT = "/abort_request"
MODEL_INFO = "/get_model_info"
REQUESTS = "/get_requests"
__all__ = ["HEALTH", "EmbeddedClient"]


class EmbeddedClient(HTTPClient):
    """One embedded server (implements ``backend.RolloutClient``): ``EmbeddedClient(url, timeout_s,
    api_key=...)``."""

    async def _call(self, method: str, path: str, body: pydantic.BaseModel | None = None) -> bytes:
        return await self._request(method, path, None if body is None else body.model_dump_json())

    async def _status(self, path: str, body: pydantic.BaseModel | None = None) -> StatusResponse:
        st = StatusResponse.model_validate_json(await self._call("POST", path, body or _EMPTY))
        if not st.success:
            raise RolloutServerError(self.url, 200, st.message or f"{path} failed")
        return st

    async def generate(self, input_ids: Sequence[int], sampling: Sampling, rid: str | None = None) -> Generation:
        req = GenerateRequest(input_ids=[int(t) for t in input_ids], sampling_params=sampling_params(sampling), rid=rid)
        return to_generation(GenerateResponse.model_validate_json(await self._call("POST", GENERATE, req)))

    async def generate_batch(
        self, input_ids: Sequence[Sequence[int]], sampling: Sequence[Sampling], rids: Sequence[str] | None = None
    ) -> list[Generation]:
        """Several prompts in one request (they are admitted together), ``sampling`` one per prompt;
        responses in order."""
        req = GenerateBatchRequest(
            input_ids=[[int(t) for t in ids] for ids in input_ids],
            sampling_params=[sampling_params(s) for s in sampling],
            rid=list(rids) if rids is not None else None,
        )
        return [to_generation(r) for r in _RESPONSES.validate_json(await self._call("POST", GENERATE, req))]

    async def pause(self) -> None:
        await self._status(PAUSE)

    async def resume(self) -> None:
        await self._status(CONTINUE)

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Returns once the server generates with the weights in ``model_path`` as ``version``."""
        await self._status(UPDATE_WEIGHTS, UpdateWeightsRequest(model_path=model_path, weight_version=version))

    async def update_weights_from_shared_memory(self, shm_name: str, specs, version: int) -> None:
        """Weights in a shared-memory segment on this host (``weight_layout.TensorSpec`` list)."""
        tensors = [SharedTensor(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset) for s in specs]
        await self._status(
            UPDATE_FROM_TENSOR,
            UpdateWeightsFromSharedMemoryRequest(shm_name=shm_name, tensors=tensors, weight_version=version),
        )

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        await self._status(
            INIT_GROUP,
            InitWeightsGroupRequest(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
        )

    async def update_weights_from_distributed(self, specs, group_name: str, version: int) -> None:
        """Returns once the server received every tensor (broadcast by rank 0) and serves ``version``."""
        await self._status(
            UPDATE_FROM_DISTRIBUTED,
            UpdateWeightsFromDistributedRequest(
                names=[s.name for s in specs],
                dtypes=[s.dtype for s in specs],
                shapes=[list(s.shape) for s in specs],
                group_name=group_name,
                weight_version=version,
            ),
        )

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of parameter ``name`` as the server holds it."""
        return json.loads(
            await self._call(
                "POST", "/get_weights_by_name", WeightsByNameRequest(name=name, truncate_size=truncate_size)
            )
        )

    async def abort_request(self, rid: str) -> None:
        """Stop request ``rid`` on the server (its output so far is returned to whoever waits for it)."""
        await self._status(ABORT, AbortRequest(rid=rid))

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        await wait_healthy(self, timeout_s)

    async def model_info(self) -> ModelInfo:
        """Everything the embedded server reports (``info`` is the part every backend has)."""
        return ModelInfo.model_validate_json(await self._call("GET", MODEL_INFO))

    async def weight_transports(self) -> list[str]:
        return (await self.model_info()).weight_transports

    async def info(self) -> ServerInfo:
        m = await self.model_info()
        return ServerInfo(
            weight_version=m.weight_version,
            running=m.running,
            waiting=m.waiting,
            paused=m.paused,
            busy_s=m.busy_s,
            reprefilled_tokens=m.reprefilled_tokens,
            kv_budget_tokens=m.kv_budget_tokens,
        )

    async def requests(self) -> RequestsSnapshot:
        """Partial outputs of the unfinished requests (a protocol extension, see protocol.py)."""
        return RequestsSnapshot.model_validate_json(await self._call("GET", REQUESTS))

    async def partial_outputs(self) -> dict[str, Generation]:
        """What each unfinished request has generated so far, by request id."""
        return {
            p.rid: Generation(list(p.output_ids), list(p.output_token_logprobs), list(p.output_token_versions), "abort")
            for p in (await self.requests()).requests
        }


class _Empty(pydantic.BaseModel):
    pass


_RESPONSES = pydantic.TypeAdapter(list[GenerateResponse])


def sampling_params(s: Sampling) -> SamplingParams:
    """``s`` as the embedded server's wire form (the seed under SGLang's name ``sampling_seed``): the
    one place a :class:`Sampling` becomes this backend's sampling params."""
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        sampling_seed=s.seed,
    )


def to_generation(resp: GenerateResponse) -> Generation:
    meta = resp.meta_info
    if [t for _, t, _ in meta.output_token_logprobs] != resp.output_ids:
        raise ValueError(f"request {meta.id}: meta_info.output_token_logprobs does not follow output_ids")
    return Generation(
        output_ids=list(resp.output_ids),
        logprobs=[lp for lp, _, _ in meta.output_token_logprobs],
        versions=list(meta.output_token_versions),
        finish_reason=meta.finish_reason.type,
    )


_EMPTY = _Empty()
