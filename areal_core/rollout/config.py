from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from areal_core.configbase import Section
from areal_core.rollout.auth import UNAUTHENTICATED_MESSAGE, ServerAuthConfig
from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, Sampling, WeightUpdateMode
from areal_core.rollout.backends.sglang import SGLangConfig
from areal_core.rollout.backends.vllm import VLLMConfig

_NEEDS_FULL = (
    "training needs the unfiltered distribution: the trainer recomputes logprobs over every "
    "token, and the kept set of a filter depends on the policy, so the importance weights "
    "would compare two different distributions (evaluation has its own sampling settings)"
)


class SamplingConfig(Section):
    """How the rollout servers sample the answers RL trains on (no top-p/top-k filtering)."""

    temperature: float = Field(1.0, ge=0)  # > 0 for RL; the trainer's logprobs use the same temperature
    # must stay 1.0 (no nucleus filtering): training needs the distribution the policy samples from, unfiltered
    top_p: float = Field(1.0, gt=0, le=1)
    # must stay 0 (no top-k filtering): training needs the distribution the policy samples from, unfiltered
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(128, gt=0)  # the most tokens one answer (one turn of an episode) may generate

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, v: float) -> float:
        if v < 1:
            raise ValueError(f"rollout.sampling.top_p must be 1.0 (no nucleus filtering): {_NEEDS_FULL}")
        return v

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, v: int) -> int:
        if v > 0:
            raise ValueError(f"rollout.sampling.top_k must be 0 (no top-k filtering): {_NEEDS_FULL}")
        return v

    def to_sampling(self, **changes) -> Sampling:
        """These settings as the :class:`Sampling` a rollout client takes, with ``changes`` (any of
        its fields, e.g. ``max_new_tokens`` or ``stop_token_ids``) in place of the configured ones."""
        base = Sampling(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )
        return dataclasses.replace(base, **changes)


class DiskTransportConfig(Section):
    """Each version saved as a folder the servers load (servers that only load from a path)."""

    kind: Literal["disk"] = "disk"


class TensorTransportConfig(Section):
    """Shared memory on one host: servers copy the weights straight out of the trainer's segment."""

    kind: Literal["tensor"] = "tensor"


class DistributedTransportConfig(Section):
    """A torch.distributed broadcast from the trainer to every server (SGLang's endpoints)."""

    kind: Literal["distributed"] = "distributed"
    backend: Literal["gloo", "nccl"] = "gloo"  # gloo on CPU, nccl on GPU
    master_address: str = "127.0.0.1"  # the trainer's address, as the servers reach it
    master_port: int | None = Field(None, gt=0, lt=65536)  # None: a free port


WeightTransportConfig = Annotated[
    DiskTransportConfig | TensorTransportConfig | DistributedTransportConfig, Field(discriminator="kind")
]


def _whole_number(v):
    """A byte count as YAML gives it: an int, an integral float (``2.0e+9``) or scientific notation
    that YAML 1.1 leaves as text (``2e9``); anything else is returned for the int check to refuse."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


class KVBudget(Section):
    """How much KV cache the running requests of one embedded engine may reserve: exactly one of
    ``tokens`` (positions) or ``bytes`` (turned into positions with the model's KV bytes per token,
    2 x layers x kv_heads x head_dim x dtype bytes). Each request reserves prompt + max_new_tokens
    positions (what it holds when it ends at its length limit) from admission until it finishes."""

    tokens: int | None = Field(None, gt=0)  # the budget in KV positions (tokens)
    bytes: int | None = Field(None, gt=0)  # the budget in bytes of KV cache (embedded servers only), e.g. 2e9

    @field_validator("bytes", mode="before")
    @classmethod
    def _bytes_as_number(cls, v):
        return _whole_number(v)

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.tokens is None) == (self.bytes is None):
            raise ValueError("kv_budget takes exactly one of 'tokens' or 'bytes', e.g. {tokens: 20000} or {bytes: 2e9}")
        return self

    def in_tokens(self, bytes_per_token: int) -> int:
        """The budget in KV positions, for a model storing ``bytes_per_token`` per position."""
        return self.tokens if self.tokens is not None else self.bytes // bytes_per_token

    def describe(self, bytes_per_token: int) -> str:
        tokens = self.in_tokens(bytes_per_token)
        return f"{tokens} tokens ({tokens * bytes_per_token} bytes at {bytes_per_token} bytes per token)"


class EngineConfig(Section):
    """Everything one embedded server's engine is configured with, built once from the run's
    config (``RolloutConfig.engine_config``) and handed to the server whole, as JSON."""

    max_running: int = Field(256, gt=0)  # sequences decoded together
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE  # what an update does to in-flight sequences
    torch_threads: int = Field(1, gt=0)  # torch (OpenMP) threads of the server
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = Field(0, ge=0)  # the sampling generator's (requests without sampling_seed)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # areal_core/device.py
    kv_budget: KVBudget | None = None  # None: admission limited by max_running alone
    batch_invariant: bool = False  # each sequence's arithmetic independent of its neighbours (kv_forward.py)
    # hash every version's weights as it goes live (models/digest.py), listed in /model_info's
    # weight_hashes: proof that every server holds the trainer's bytes; one pass over the weights per update
    weight_hashes: bool = False


class EmbeddedBackendConfig(Section):
    """The embedded engine: ``rollout.n_servers`` child processes on this host."""

    kind: Literal["embedded"] = "embedded"


class ExternalBackendConfig(ServerAuthConfig):
    """Servers someone else started that speak the embedded engine's protocol (protocol.py), with
    their API key from ``api_key_file`` or ``api_key_env`` (auth.py), or ``allow_unauthenticated``."""

    kind: Literal["external"] = "external"
    urls: list[str] = Field(min_length=1)  # the servers' base URLs

    @model_validator(mode="after")
    def _key_or_consent(self):
        if self.needs_key():
            raise ValueError(UNAUTHENTICATED_MESSAGE.format(what="rollout.backend external servers"))
        return self


# one member per backend; the backend's own file defines its config (backends/<name>.py)
RolloutBackendConfig = Annotated[
    EmbeddedBackendConfig | ExternalBackendConfig | SGLangConfig | VLLMConfig, Field(discriminator="kind")
]


class RolloutConfig(Section):
    """The rollout servers that generate the answers, how many answers per prompt and how they are sampled."""

    # which servers generate: {kind: embedded} (the shorthand `backend: embedded` works too),
    # {kind: external, urls: [...]}, {kind: sglang, ...} (backends/sglang.py), {kind: vllm, ...}
    # (backends/vllm.py)
    backend: RolloutBackendConfig = EmbeddedBackendConfig()
    n_servers: int = Field(1, gt=0)  # embedded servers to start
    max_running: int = Field(256, gt=0)  # sequences decoded together by one embedded server
    # what a weight update does to in-flight sequences: reprefill (AReaL: re-prefill them with the
    # new weights), keep_kv (PipelineRL: continue on the old KV cache), drain (finish them first)
    weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE
    # how weights reach the servers; None: the fastest that works for the backend
    # (embedded servers on this host: tensor; external and SGLang servers: distributed; vLLM: disk)
    weight_transport: WeightTransportConfig | None = None
    n_samples: int = Field(8, gt=0)  # answers per prompt
    sampling: SamplingConfig = SamplingConfig()
    torch_threads: int = Field(1, gt=0)  # torch (OpenMP) threads of each embedded server
    # what the servers compute in: `model` = what model.dtype gives them (the trainer's dtype where
    # model.dtype names one; auto: bfloat16 on a GPU or a CPU with bf16 units, beside a float32 trainer
    # on such a CPU); float32 or bfloat16 apart from it, e.g. a bf16 engine beside a float32 trainer, the
    # numerics mismatch large deployments live with (in-memory pushes are cast to it, a disk folder as the servers load it;
    # the step metrics logprob_gap_* measure the gap)
    dtype: Literal["model", "float32", "bfloat16"] = "model"
    # how long one request may take from sending to its whole answer, waiting in the server's queue
    # included (the held-out evaluation sends all its problems at once); past it the request is aborted
    # and sent again (training) or the evaluation fails naming this setting; also how long a restarted
    # or rejoining server may take to report healthy
    request_timeout_s: float = Field(600.0, gt=0)
    # KV cache the running requests of one server may reserve: {tokens: N} or {bytes: N} (embedded
    # servers enforce it; for others the rollout client keeps it, tokens only); a request waits (FIFO)
    # until its prompt + max_new_tokens fit; None: no limit but max_running
    kv_budget: KVBudget | None = None
    # embedded servers: each answer's arithmetic independent of the answers decoded beside it, so its
    # tokens and logprobs repeat bit for bit whatever else ran (at the cost docs/PERFORMANCE.md gives);
    # what makes runs repeat exactly (docs/OPERATIONS.md, "Debugging a run"). None (the default): on
    # exactly where the run is deterministic (below)
    batch_invariant: bool | None = None
    # runs that repeat: wave k (the batch of step k + 1) is generated entirely at version max(0, k - eta)
    # (a new version reaches the servers only once the waves it must not touch are rewarded), batches
    # follow admission order and the curriculum learns from finished groups in admission order, so
    # neither timing nor load changes what is trained; costs an asynchronous run throughput
    # (docs/PERFORMANCE.md); needs batch_invariant. None (the default): on for synchronous runs
    # (trainer.eta 0) on embedded servers without multi_agent, where it costs nothing but the
    # batch-invariant arithmetic: a synchronous run then repeats bit for bit, idle or loaded
    deterministic: bool | None = None
    # an elastic pool (servers on preemptible hosts; docs/OPERATIONS.md, "Elastic rollout pools"): a
    # server this run did not start that dies leaves the pool, its answers continue on the others from
    # what it had generated; with fewer than this many left the run stops at a checkpoint (resume with
    # --resume once servers are back). None: a dead server is restarted (embedded) or waited for
    min_servers: int | None = Field(None, gt=0)
    # servers that join the running run: a file (path or fsspec URL, e.g. s3://...) listing base URLs,
    # one per line, read every 2 s; a URL added there joins once it holds the current weights (the
    # serve flow's join_run parameter appends its servers). None: the pool keeps its first servers
    join_from: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data):
        if isinstance(data, dict) and "urls" in data:
            raise ValueError("rollout.urls moved into the backend: write 'backend: {kind: external, urls: [...]}'")
        if isinstance(data, dict) and isinstance(data.get("backend"), str):  # `backend: embedded` shorthand
            data = {**data, "backend": {"kind": data["backend"]}}
        if isinstance(data, dict) and "interruptible" in data:
            raise ValueError(
                "rollout.interruptible was replaced by rollout.weight_update: write "
                "'weight_update: reprefill' for interruptible: true, 'weight_update: drain' for "
                "interruptible: false (or 'keep_kv' to keep the KV cache across updates)"
            )
        return data

    @model_validator(mode="after")
    def _backend_can_take_the_transport(self):
        b, t = self.backend, self.weight_transport
        if b.kind == "sglang" and t is not None and t.kind == "tensor":
            raise ValueError(
                "rollout.weight_transport kind 'tensor' is not supported by rollout.backend kind "
                "'sglang' (SGLang's tensor update passes CUDA IPC handles; use 'distributed' or "
                "'disk')"
            )
        if b.kind == "vllm" and t is not None and t.kind != "disk":
            raise ValueError(
                f"rollout.weight_transport kind {t.kind!r} is not supported by rollout.backend kind "
                "'vllm' (its servers reload from a folder: use 'disk')"
            )
        return self

    @model_validator(mode="after")
    def _enough_servers(self):
        first = (
            len(getattr(self.backend, "urls", None) or [])
            or getattr(self.backend, "num_servers", None)
            or self.n_servers
        )
        if self.min_servers is not None and not self.join_from and self.min_servers > first:
            raise ValueError(
                f"rollout.min_servers ({self.min_servers}) is more than the {first} server(s) the run "
                "starts with, and none can join (rollout.join_from is not set)"
            )
        return self

    @model_validator(mode="after")
    def _kv_budget_fits(self):
        kv = self.kv_budget
        if kv is None:
            return self
        if self.backend.kind != "embedded" and kv.tokens is None:
            raise ValueError(
                f"rollout.kv_budget for rollout.backend kind {self.backend.kind!r} is a limit the client "
                f"keeps per server, in KV positions: give {{tokens: N}} (bytes need the server's KV "
                f"bytes per token, which only the embedded engine knows)"
            )
        need = self.sampling.max_new_tokens + 1
        if kv.tokens is not None and kv.tokens < need:
            raise ValueError(
                f"rollout.kv_budget.tokens ({kv.tokens}) cannot hold one request: at least 1 prompt "
                f"token + rollout.sampling.max_new_tokens ({self.sampling.max_new_tokens}) = {need}"
            )
        return self

    def client_kv_budget_tokens(self) -> int | None:
        """The KV budget the rollout client keeps per server: external backends' (the embedded
        engine enforces its own)."""
        if self.kv_budget is None or self.backend.kind == "embedded":
            return None
        return self.kv_budget.tokens

    def servers_dtype(self, model_dtype: str) -> str:
        """What the servers compute in: ``model_dtype`` (what ``model.dtype`` gives them,
        ``models.loading.servers_model_dtype``) unless this section's ``dtype`` names another."""
        return model_dtype if self.dtype == "model" else self.dtype

    def engine_config(self, *, seed: int, dtype: str, device: str = "auto") -> EngineConfig:
        """The engine's settings (``seed``: the run's; each server derives its own; ``dtype``: what
        ``model.dtype`` gives the servers, which they compute in unless this section's ``dtype`` names
        another)."""
        return EngineConfig(
            max_running=self.max_running,
            weight_update=self.weight_update,
            torch_threads=self.torch_threads,
            dtype=self.servers_dtype(dtype),
            seed=seed,
            device=device,
            kv_budget=self.kv_budget,
            batch_invariant=bool(self.batch_invariant),  # (None: a config not yet resolved by a run's)
        )

    def transport(self) -> WeightTransportConfig:
        """The configured weight transport, or the default for the backend."""
        if self.weight_transport is not None:
            return self.weight_transport
        default = {"embedded": TensorTransportConfig, "vllm": DiskTransportConfig}
        return default.get(self.backend.kind, DistributedTransportConfig)()
