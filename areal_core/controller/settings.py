"""What a rollout controller is given: its settings, its servers, and the ids it gives groups."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from areal_core.controller.agents import AgentRouter
from areal_core.rollout.backend import Sampling
from areal_core.types import Prompt

Restart = Callable[[int, str, int], None]  # (server index, model folder, version), blocking


@dataclass
class ControllerSettings:
    batch_size: int
    eta: int
    n_samples: int
    # what every request samples with; its max_new_tokens is a turn's default (each request gets its own
    # max_new_tokens and stop tokens)
    sampling: Sampling
    reward_correct: float
    reward_wrong: float
    shuffle: bool = True
    seed: int = 0
    curriculum: dict | None = None  # {"ema": .., "floor": ..}: BucketCurriculum over Prompt.bucket
    kv_budget_tokens: int | None = None  # a client-side KV limit per server (servers that do not enforce one)
    # prompt + answer of one trajectory at most (run/budget.py); every request's max_new_tokens is
    # clamped to what it leaves. None: no limit
    max_trajectory_tokens: int | None = None
    # rollout.deterministic: admission waves generated at fixed versions, curriculum fed in order
    # (admission.py, core.py); the buffer is then ordered too (buffer.py)
    deterministic: bool = False
    # rollout.min_servers: an elastic pool (controller/elastic.py); servers that die leave it, and with fewer
    # left than this the run stops at a checkpoint. None: dead servers are restarted or waited for
    min_servers: int | None = None


@dataclass
class Servers:
    """One policy's rollout servers and how to reach and restart them."""

    urls: list[str]
    model_path: str = ""
    """A checkpoint folder a restarted server starts from (``RolloutController.restart_from`` moves it
    on); the weight transport then brings it to the current weights."""
    restart: Restart | None = None
    """``restart(i, model_path, version)`` restarts server ``i`` (blocking); None for servers managed
    elsewhere, which the controller waits for instead."""
    make_client: Callable | None = None
    """The rollout backend's client for a URL (None: the embedded server's)."""
    request_timeout_s: float = 600.0
    discover: Callable[[], list[str]] | None = None
    """The base URLs of servers announced to join the run, read every few seconds (controller/elastic.py);
    None: no server joins."""


@dataclass
class AgentSetup:
    """A multi-agent run's routing (``areal_core/controller/agents.py``): each prompt group goes, when it is
    admitted, to the trainable policy or to the frozen one."""

    router: AgentRouter
    prompt: Callable[[str, Prompt], list[int]] | None = None
    """``prompt(agent, prompt)``: the prompt ids in that agent's style (None: the prompt as it is)."""
    frozen: Servers | None = None
    """The frozen policy's servers: they hold ``frozen.model_path`` at ``frozen_version`` and never
    get weights. Needed when some agents are routed to it."""
    frozen_version: int = 0


def group_id(epoch: int, prompt_id: str) -> str:
    """The id of a group of answers: ``e{epoch}-p{prompt id}`` (a trajectory's adds ``-s{k}``)."""
    return f"e{epoch}-p{prompt_id}"


def prompt_of(group: str) -> str:
    """The prompt id in a :func:`group_id`."""
    return group.split("-p", 1)[1]
