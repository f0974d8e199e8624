"""A training run's folder: its default name, and the checks made before anything is written to it.

Every check here runs before a run starts (``areal-flow train``, the ``train`` flow, and
``run_experiment`` itself), so a refused run leaves the folder exactly as it found it
(``config.json`` included). Each refusal is a :class:`RunFolderError` with a one-line message
that says what happened and what to set.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

RUNS_ROOT_ENV = "AREAL_RUNS_DIR"  # where runs without a named folder go (default: runs/)


class RunFolderError(ValueError):
    """The run cannot start with this folder, config or data (a user error: one line, no traceback)."""


def runs_root() -> str:
    return os.environ.get(RUNS_ROOT_ENV) or "runs"


def slug(text: str) -> str:
    """Lowercase letters, digits, dots and dashes (a folder name, an artifact key's part)."""
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-.")


def default_run_dir(name: str, started: datetime | None = None) -> str:
    """``<runs root>/<name>-<YYYYmmdd-HHMMSS>``: a folder of its own for each run that names none."""
    stamp = (started or datetime.now()).astimezone().strftime("%Y%m%d-%H%M%S")
    return os.path.join(runs_root(), f"{slug(name) or 'run'}-{stamp}")


def check_run_folder(
    cfg,
    run_dir: str | os.PathLike,
    resume: bool,
    *,
    how_resume: str = "add --resume",
    how_new: str = "give a new --run-dir",
) -> int | None:
    """The newest complete checkpoint version in the run's store (None if none), after checking that
    the run may start: a store that already holds checkpoints is continued only with ``resume``, and
    then only if its state matches ``cfg``. ``how_resume`` / ``how_new``: what the user does to
    continue that run or to start a new one (a CLI flag, a flow parameter), said in the message."""
    from areal_core.experiment import upgraded_config
    from areal_core.storage import CheckpointStore
    from areal_core.storage.run_state import ResumeError, check_resumable

    where = cfg.storage.url or str(Path(run_dir) / "checkpoints")
    store = CheckpointStore.from_config(cfg.storage, str(run_dir))
    latest = store.latest()
    if latest is None:
        return None
    if not resume:
        other = "set storage.url to a new prefix" if cfg.storage.url else how_new
        raise RunFolderError(
            f"{where} already holds a run's checkpoints (latest v{latest}), and a new run "
            f"would overwrite them: {how_resume} to continue that run, or {other}"
        )
    try:
        check_resumable(store, cfg.model_dump(mode="json"), upgrade=upgraded_config)
    except ResumeError as e:
        raise RunFolderError(f"cannot resume {where}: {e}") from None
    return latest


def claim_run_dir(name: str, started: datetime | None = None) -> str:
    """A new folder for a run that names none (:func:`default_run_dir`), made here so that two runs
    started in the same second get two folders (``-2``, ``-3``, ... on the second)."""
    base = default_run_dir(name, started)
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.makedirs(path)
        except FileExistsError:
            continue
        return path
    raise RunFolderError(f"{base}: 999 run folders of that name already exist")


def check_inputs(cfg) -> None:
    """What a run reads before it starts: records files (every line) and a rollout backend's venv."""
    if not (cfg.data.dataset == "synthetic" and cfg.data.eval_dataset is None):
        from areal_core.data.datasets import load_records

        try:
            load_records(cfg.data)
        except ValueError as e:  # RecordError names the file, line and field
            raise RunFolderError(str(e)) from None
    if cfg.rollout.backend.kind == "vllm":
        from areal_core.rollout.backends.vllm import venv_python

        try:
            venv_python(cfg.rollout.backend)
        except FileNotFoundError as e:
            raise RunFolderError(str(e)) from None


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _short(key: str, value) -> str:
    leaf = key.rsplit(".", 1)[-1]
    if isinstance(value, str):  # a short word (naive, drain) as it is; a path or long text by its key
        return value if len(value) <= 16 and "/" not in value else leaf
    if isinstance(value, float):
        return f"{leaf}{value:g}"
    if isinstance(value, (bool, int)):
        return f"{leaf}{value}"
    return leaf


def describe_run(config_path: str, overrides: dict | None = None, max_steps: int | None = None) -> str:
    """A run's name from what it runs: the config's name, the overrides whose value differs from the
    config's, the step count if it differs, and the seed: ``quickstart-eta0-steps20-s1``."""
    from areal_core.experiment import load_config

    overrides = dict(overrides or {})
    cfg = load_config(config_path, overrides)
    base = load_config(config_path).model_dump(mode="json")
    now = cfg.model_dump(mode="json")
    parts = [cfg.name]
    for key in overrides:
        if key not in ("seed", "name") and _get(now, key) != _get(base, key):
            parts.append(_short(key, _get(now, key)))
    if max_steps and max_steps != cfg.trainer.max_steps:
        parts.append(f"steps{max_steps}")
    parts.append(f"s{cfg.seed}")
    return slug("-".join(parts))[:80]


def code_version() -> dict:
    """The code a run ran: the git commit of this checkout and a digest of its uncommitted changes to
    the code (``changes``, None where there are none), or the package's version where it is not a git
    checkout. A campaign reuses a run only at the same code."""
    import hashlib
    import subprocess

    import areal_core

    root = Path(areal_core.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        code = ["areal_core", "flows", "tasks"]  # (what runs; docs, benchmarks and results may change)
        diff = subprocess.run(["git", "diff", "HEAD", "--", *code], cwd=root, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changes": None, "version": areal_core.__version__}
    # uncommitted changes to tracked files: their digest, so a run at the same changes counts as the same code
    changes = hashlib.sha256(diff).hexdigest()[:16] if diff else None
    return {"commit": commit, "changes": changes, "version": areal_core.__version__}
