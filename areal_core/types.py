"""Records that cross component boundaries (datasets -> controller -> buffer -> trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prompt:
    """A dataset record ready for generation."""

    id: str
    task: str
    input_ids: list[int]
    reference: str
    bucket: str | None = None  # for the curriculum: the record's meta field it is grouped by
    tests: list[dict] | None = None  # code: the record's unit tests, sent with each answer to the grader


@dataclass
class Trajectory:
    """One sampled answer to one prompt, with everything the trainer needs.

    ``traj_id`` is stable across regeneration and resume:
    ``e{epoch}-p{prompt_id}-s{sample_index}``.
    """

    traj_id: str
    group_id: str  # answers to the same prompt in the same epoch share it
    seq_no: int  # admission order N (0-based) used by the staleness gate
    admit_version: int  # policy version of the servers when it was admitted
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # behaviour logprobs
    output_versions: list[int] = field(default_factory=list)  # version that sampled each token
    # 1: a token the policy sampled (trained); 0: environment or tool text inside a multi-turn
    # answer (never trained: no loss, no staleness). Empty: every output token is the policy's.
    output_mask: list[int] = field(default_factory=list)
    finish_reason: str = ""
    reference: str = ""  # what the reward function compares against
    task: str = ""  # the record's task kind, which picks the grader
    reward: float | None = None
    correct: bool | None = None
    reward_info: dict = field(default_factory=dict)
    # multi-agent runs (areal_core/controller/agents.py); the defaults are what a run without agents (or a
    # state saved before these fields) has
    agent_id: str = ""  # the agent whose prompting style made the prompt ("" without agents)
    route: str = ""  # the policy it was routed to at admission: "trainable" | "frozen" ("": trainable, no agents)
    policy_version: int | None = None  # behaviour version: the oldest version that sampled one of its policy tokens

    @property
    def finished(self) -> bool:
        """Generation is complete (a partial trajectory has ``finish_reason`` "")."""
        return self.finish_reason != ""

    @property
    def n_output_tokens(self) -> int:
        return len(self.output_ids)

    def policy_token_versions(self) -> list[int]:
        """The versions of the tokens the policy sampled (a multi-turn answer's environment text excluded)."""
        if not self.output_mask:
            return list(self.output_versions)
        return [v for v, m in zip(self.output_versions, self.output_mask) if m]

    def to_row(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_row(cls, row: dict) -> Trajectory:
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})
