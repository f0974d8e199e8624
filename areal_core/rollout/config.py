from __future__ import annotations

from pydantic import Field

from areal_core.configbase import Section


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no top-k
    max_new_tokens: int = Field(128, gt=0)


class RolloutConfig(Section):
    backend: str = Field("embedded", pattern="^(embedded|external)$")
    n_servers: int = Field(1, gt=0)  # embedded servers to start
    urls: list[str] = []  # external servers (backend: external)
    max_running: int = Field(256, gt=0)  # sequences decoded together by one embedded server
    interruptible: bool = True  # weight updates interrupt and re-prefill in-flight sequences
    n_samples: int = Field(8, gt=0)  # answers per prompt
    sampling: SamplingConfig = SamplingConfig()
    torch_threads: int = Field(1, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
