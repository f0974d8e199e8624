"""A run's resumable state, published inside each checkpoint version.

Every version ``v<N>/`` of a run's CheckpointStore holds, besides the model:

    resume/state.json       step, version, prompt-stream position, everything
                            admitted and not trained (buffered, being graded, and
                            partially generated answers with their tokens, logprobs
                            and per-token versions), held-out accuracy before RL,
                            the code that wrote it (``run.folder.code_version``)
    resume/trainer.pt       optimizer and lr-scheduler state (torch.save)
    resume/metrics.parquet  the metrics rows of steps 1..N
    resume/ledger.parquet   the ledger rows of steps 1..N

They are written into the version before its manifest, so they appear together
with the weights of step N or not at all: a run killed at any moment resumes
from its latest complete version, which is always a consistent state. A finished
run may drop its optimizer state (:func:`drop_trainer_state`, two thirds of a
version's bytes): its weights stay, continuing or replaying it no longer can.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import logging
from dataclasses import dataclass

import torch

from areal_core.numerics import one_thread
from areal_core.storage.checkpoints import CheckpointError, CheckpointStore
from areal_core.storage.config_keys import MUTABLE_KEYS, config_differences
from areal_core.storage.fsutil import FileData

log = logging.getLogger(__name__)

FORMAT = "areal-run-state/1"
STATE, TRAINER, METRICS, LEDGER = (
    "resume/state.json",
    "resume/trainer.pt",
    "resume/metrics.parquet",
    "resume/ledger.parquet",
)


class ResumeError(CheckpointError):
    """The run cannot be resumed from what is in its checkpoint store."""


@dataclass
class RunState:
    version: int  # the checkpoint version this state belongs to (= training steps done)
    state: dict  # the JSON part
    trainer: dict  # Trainer.state_dict()
    metrics: bytes
    ledger: bytes

    @property
    def step(self) -> int:
        return int(self.state["step"])


def encode(
    step: int,
    config: dict,
    controller: dict,
    trainer: dict,
    runlog_files: dict[str, bytes],
    before: dict | None,
    code: dict,
) -> dict[str, FileData]:
    """The files of a run state, for ``CheckpointStore.publish(..., extra=...)`` or a
    ``CheckpointWriter``; ``code``: the code that wrote it, as the run's summary names it; ``trainer``:
    the trainer's ``state_dict()``. Its tensors are copied here (the next step may change them in
    place) and serialized when the file is written, straight into it: with a ``CheckpointWriter``
    on its thread while training goes on (for SmolLM2-135M, 1.6 GB)."""
    state = {
        "format": FORMAT,
        "step": step,
        "config": config,
        "controller": controller,
        "before": before,
        "code": code,
    }
    return {
        STATE: json.dumps(state).encode(),
        TRAINER: functools.partial(torch.save, _copy(trainer)),
        METRICS: runlog_files["metrics.parquet"],
        LEDGER: runlog_files["ledger.parquet"],
    }


def _copy(trainer: dict) -> dict:
    """A copy of the trainer state, made on one thread: a memory-bound copy gains little from more,
    and threads beyond the trainer's own would collide with servers generating beside it."""
    with one_thread():
        return copy.deepcopy(trainer)


def check_resumable(store: CheckpointStore, config: dict, upgrade=None) -> tuple[int, dict] | None:
    """(version, run state) of the newest complete version, or None if the store has none; reads
    only the small JSON state, so a caller can check before anything starts.

    Raises ResumeError if that version has no run state (written by an older
    areal-flow, or by something else), or if ``config`` differs from the stopped
    run's in a key that a resume may not change. ``upgrade(saved config)``: the saved config as
    this areal-flow reads it (keys added since get their defaults); a ValueError keeps it as saved."""
    version = store.latest()
    if version is None:
        return None
    try:
        raw = store.read_file(version, STATE)
    except FileNotFoundError as err:
        raise ResumeError(f"{store.version_url(version)} holds no run state ({STATE}); it cannot be resumed") from err
    try:
        state = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResumeError(f"{store.version_url(version)}/{STATE}: not valid JSON ({err})") from err
    if TRAINER in store.read_manifest(version)["meta"].get("dropped", []):
        raise ResumeError(
            f"{store.version_url(version)} no longer holds the optimizer state ({TRAINER}): it was dropped once the "
            "run finished (a campaign keeps its runs' weights only, unless started with --keep-run-state)"
        )
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("step") != version:
        raise ResumeError(
            f"{store.version_url(version)}/{STATE}: not a run state of step {version} "
            f"(format {state.get('format') if isinstance(state, dict) else None!r})"
        )
    saved = state["config"]
    if upgrade is not None:
        try:
            saved = upgrade(saved)
        except ValueError:  # no longer a valid config: compared as saved, so its differences show
            pass
    diff = config_differences(saved, config)
    if diff:
        raise ResumeError(
            f"the config differs from the stopped run's in {', '.join(diff[:10])}; "
            f"a resumed run may change only {', '.join(MUTABLE_KEYS)}"
        )
    return version, state


def drop_trainer_state(store: CheckpointStore) -> int:
    """Drop the optimizer state from every complete version of a finished run's ``store`` (its weights,
    run state, metrics and ledger stay); the bytes freed."""
    return sum(store.drop_files(v, [TRAINER]) for v in store.versions())


def load_latest(store: CheckpointStore, config: dict, upgrade=None) -> RunState | None:
    """The state of the newest complete version (see :func:`check_resumable`), or None."""
    found = check_resumable(store, config, upgrade)
    if found is None:
        return None
    version, state = found
    trainer = torch.load(io.BytesIO(store.read_file(version, TRAINER)), weights_only=True)
    log.info("resuming from %s (step %d)", store.version_url(version), version)
    return RunState(version, state, trainer, store.read_file(version, METRICS), store.read_file(version, LEDGER))
