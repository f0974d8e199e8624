"""The rollout server's HTTP protocol: the subset of SGLang's server API we use.

Request and response bodies are validated on both sides with these models.
Endpoints (all JSON):

  POST /generate                  GenerateRequest -> GenerateResponse
  POST /pause_generation          {}              -> StatusResponse
  POST /continue_generation       {}              -> StatusResponse
  POST /update_weights_from_disk  UpdateWeightsRequest -> StatusResponse
  GET  /health                    -> 200 {"status": "ok"}
  GET  /get_model_info            -> ModelInfo
  GET  /get_requests              -> RequestsSnapshot (extension: partial outputs so far)

Extension over SGLang: ``meta_info.output_token_versions`` gives, for each output
token, the weight version that sampled it (SGLang reports one ``weight_version``
per request). A second extension, ``/get_requests``, lists the partial output of
every unfinished request without disturbing it; the controller saves it so a
resumed run continues those answers instead of starting them again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS_PER_REQUEST = 1 << 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParams(_Body):
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 or -1 in SGLang: disabled
    max_new_tokens: int = Field(128, gt=0, le=MAX_TOKENS_PER_REQUEST)
    stop_token_ids: list[int] = []  # besides the model's EOS
    ignore_eos: bool = False


class GenerateRequest(_Body):
    input_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS_PER_REQUEST)
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = True
    rid: str | None = Field(None, max_length=256)  # request id, echoed back as meta_info.id
    seed: int | None = None


class FinishReason(_Body):
    type: Literal["stop", "length", "abort"]
    matched: int | None = None  # the stop token that ended it


class MetaInfo(_Body):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[tuple[float, int, None]]  # (logprob, token id, text) as in SGLang
    output_token_versions: list[int]
    weight_version: int  # version when the request finished


class GenerateResponse(_Body):
    output_ids: list[int]
    meta_info: MetaInfo


class UpdateWeightsRequest(_Body):
    model_path: str = Field(min_length=1, max_length=4096)  # local folder or fsspec URL
    weight_version: int = Field(ge=0)
    load_format: str | None = None  # accepted for SGLang compatibility; safetensors only


class StatusResponse(_Body):
    success: bool
    message: str = ""


class ModelInfo(_Body):
    model_path: str
    weight_version: int
    is_generation: bool = True
    max_running: int
    running: int
    waiting: int
    paused: bool
    interruptible: bool
    generated_tokens: int  # since start
    eos_token_id: int | None


class PartialOutput(_Body):
    """What an unfinished request has generated so far (running or waiting)."""

    rid: str
    output_ids: list[int]
    output_token_logprobs: list[float]
    output_token_versions: list[int]


class RequestsSnapshot(_Body):
    weight_version: int
    requests: list[PartialOutput]
