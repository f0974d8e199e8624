from __future__ import annotations

from pydantic import Field

from areal_core.configbase import Section


class EvalConfig(Section):
    n_problems: int = Field(500, gt=0)  # held-out problems for accuracy_before / accuracy_after
    temperature: float = Field(0.0, ge=0)  # 0: greedy
    max_new_tokens: int | None = Field(None, gt=0)  # default: rollout.sampling.max_new_tokens
