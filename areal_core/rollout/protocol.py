"""The rollout server's HTTP protocol: the subset of SGLang's server API we use.

Request and response bodies are validated on both sides with these models. A server refuses a
request field it does not know (a misspelt setting fails loudly); a client ignores a reply field it
does not know, so a client keeps working with a newer server that reports more.
Endpoints (all JSON):

  POST /generate                  GenerateRequest -> GenerateResponse, or
                                  GenerateBatchRequest -> [GenerateResponse, ...] (input_ids a list of lists)
  POST /pause_generation          {}              -> StatusResponse
  POST /continue_generation       {}              -> StatusResponse
  POST /update_weights_from_disk  UpdateWeightsRequest -> StatusResponse
  POST /init_weights_update_group InitWeightsGroupRequest -> StatusResponse
  POST /update_weights_from_distributed  UpdateWeightsFromDistributedRequest -> StatusResponse
  POST /update_weights_from_tensor       UpdateWeightsFromSharedMemoryRequest -> StatusResponse
  POST /abort_request             AbortRequest -> StatusResponse
  POST /get_weights_by_name       WeightsByNameRequest -> list of numbers (first truncate_size)
  GET  /health                    -> 200 {"status": "ok"}
  GET  /get_model_info            -> ModelInfo
  GET  /get_requests              -> RequestsSnapshot (extension: partial outputs so far)

The distributed update has SGLang's fields (the trainer is rank 0 of a process group the
servers join; it broadcasts each named tensor in order). ``/update_weights_from_tensor``
keeps SGLang's idea (weights handed over in memory, no file) with a body of our own: on
one host the tensors lie in a named shared-memory segment, described by name, dtype,
shape and byte offset, instead of SGLang's pickled CUDA IPC handles.

Extension over SGLang: ``meta_info.output_token_versions`` gives, for each output
token, the weight version that sampled it (SGLang reports one ``weight_version``
per request). A second extension, ``/get_requests``, lists the partial output of
every unfinished request without disturbing it; the controller saves it so a
resumed run continues those answers instead of starting them again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_core.rollout.backend import WeightUpdateMode

MAX_TOKENS_PER_REQUEST = 1 << 16
MAX_SEED = 1 << 63


class _Body(BaseModel):
    """A request body: unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Reply(BaseModel):
    """A reply body: unknown fields (a newer server's) ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class SamplingParams(_Body):
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 or -1 in SGLang: disabled
    max_new_tokens: int = Field(128, gt=0, le=MAX_TOKENS_PER_REQUEST)
    stop_token_ids: list[int] = []  # besides the model's EOS
    ignore_eos: bool = False
    # SGLang's name: this request's own random stream (same seed, same answer); None: the server's
    sampling_seed: int | None = Field(None, ge=0, lt=MAX_SEED)


class GenerateRequest(_Body):
    input_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS_PER_REQUEST)
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = True
    rid: str | None = Field(None, max_length=256)  # request id, echoed back as meta_info.id


class GenerateBatchRequest(_Body):
    """Several prompts in one call (SGLang's batched /generate): one response each, in order.
    ``sampling_params``: one for all prompts, or a list with one per prompt (e.g. each its own seed)."""

    input_ids: list[list[int]] = Field(min_length=1, max_length=4096)
    sampling_params: SamplingParams | list[SamplingParams] = SamplingParams()
    return_logprob: bool = True
    rid: list[str] | None = None

    def model_post_init(self, _context) -> None:
        n = len(self.input_ids)
        if self.rid is not None and len(self.rid) != n:
            raise ValueError(f"rid has {len(self.rid)} ids for {n} prompts")
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != n:
            raise ValueError(f"sampling_params has {len(self.sampling_params)} entries for {n} prompts")

    def per_prompt(self) -> list[SamplingParams]:
        sp = self.sampling_params
        return sp if isinstance(sp, list) else [sp] * len(self.input_ids)


class FinishReason(_Reply):
    type: Literal["stop", "length", "abort"]
    matched: int | None = None  # the stop token that ended it


class MetaInfo(_Reply):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[tuple[float, int, None]]  # (logprob, token id, text) as in SGLang
    output_token_versions: list[int]
    weight_version: int  # version when the request finished


class GenerateResponse(_Reply):
    output_ids: list[int]
    meta_info: MetaInfo


class _VersionedUpdate(_Body):
    weight_version: int = Field(ge=0)
    flush_cache: bool = True  # accepted for SGLang compatibility; the engine's mode decides the cache
    abort_all_requests: bool = False  # finish every in-flight request with abort before loading


class UpdateWeightsRequest(_VersionedUpdate):
    model_path: str = Field(min_length=1, max_length=4096)  # local folder or fsspec URL
    load_format: str | None = None  # accepted for SGLang compatibility; safetensors only


class InitWeightsGroupRequest(_Body):
    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(min_length=1, max_length=256)
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateWeightsFromDistributedRequest(_VersionedUpdate):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(min_length=1, max_length=256)


class SharedTensor(_Body):
    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)


class UpdateWeightsFromSharedMemoryRequest(_VersionedUpdate):
    shm_name: str = Field(min_length=1, max_length=255)
    tensors: list[SharedTensor] = Field(min_length=1)


class WeightsByNameRequest(_Body):
    name: str = Field(min_length=1, max_length=512)
    truncate_size: int = Field(100, gt=0, le=1 << 24)  # values of the flattened tensor, from the start


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class StatusResponse(_Reply):
    success: bool
    message: str = ""


class ModelInfo(_Reply):
    model_path: str
    weight_version: int
    is_generation: bool = True
    max_running: int
    running: int
    waiting: int
    paused: bool
    weight_update: WeightUpdateMode
    weight_transports: list[str] = ["disk"]  # how this server can receive weights
    generated_tokens: int  # since start
    eos_token_id: int | None
    # seconds the engine loop spent applying the last weight update (generation stops only then)
    last_update_stall_s: float | None = None
    busy_s: float = 0.0  # seconds the engine spent generating and applying weights, since start
    reprefilled_tokens: int = 0  # positions prefilled again after weight updates (reprefill mode), since start
    # the KV positions its budget holds (rollout.kv_budget; bytes converted at its model's size per
    # position): no request may reserve more; None: no budget
    kv_budget_tokens: int | None = None
    # version -> SHA-256 of the weights it went live with (models/digest.py); servers started with
    # engine config weight_hashes only, else empty
    weight_hashes: dict[int, str] = {}
    # the CPU kind and kernels the server computes with, MKL's reproducibility mode among them
    # (areal_core/numerics.py cpu_kind); None from servers that do not say
    numerics: dict | None = None


class PartialOutput(_Reply):
    """What an unfinished request has generated so far (running or waiting)."""

    rid: str
    output_ids: list[int]
    output_token_logprobs: list[float]
    output_token_versions: list[int]


class RequestsSnapshot(_Reply):
    weight_version: int
    requests: list[PartialOutput]
