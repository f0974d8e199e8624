"""The parts a run's setup builds, step by step (``run/setup.py``), handed to the steps after it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from areal_core.controller.agents import AgentRouter
from areal_core.data.prompting import decode_response
from areal_core.experiment import ExperimentConfig
from areal_core.reward.service import RewardService
from areal_core.run.metrics import RunLog
from areal_core.storage import CheckpointStore


@dataclasses.dataclass
class RunSetup:
    """What the first step settles: the run's folder, length, the trainer's threads and its config."""

    cfg: ExperimentConfig
    dir: Path
    steps: int
    trainer_threads: int
    config: dict  # the config as written to config.json
    code: dict  # the code the run runs (run/folder.py code_version): its checkpoints and summary name it
    progress: bool
    t_start: float

    def phase(self, text: str) -> None:
        """Say what the run is doing before (and after) its progress bar."""
        if self.progress:
            tqdm.write(f"[{self.cfg.name}] {text}")


@dataclasses.dataclass
class Policy:
    """The model being trained, its tokenizer, and the prompts it trains and is evaluated on."""

    model: torch.nn.Module
    tokenizer: object
    info: dict  # what loading it found out (the warm start's figures)
    train_records: list
    eval_records: list
    train_prompts: list
    eval_prompts: list
    agents: AgentRouter | None  # several agents, each group one agent's (controller/agents.py)
    prompter: Callable | None

    def decode(self, ids: list[int]) -> str:
        return decode_response(self.tokenizer, ids)


@dataclasses.dataclass
class Training:
    """The trainer, the run's store and log, and where training starts (fresh or resumed)."""

    trainer: object
    store: CheckpointStore
    runlog: RunLog
    version: int
    before: dict | None  # held-out accuracy before RL, where a resumed run had measured it
    saved: object | None  # the resumed checkpoint's state


@dataclasses.dataclass
class Pools:
    """The run's reward workers and rollout servers (the frozen policy's too, in multi-agent runs)."""

    rewards: RewardService
    urls: list[str]
    frozen_urls: list[str]
    backend: object
    frozen_backend: object | None
    engine: object  # the servers' engine config
    start: str  # what the servers loaded at start
    server_copy: Callable[[int], str]  # a version's folder (or URL) as servers load it
