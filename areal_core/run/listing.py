"""What ``areal-flow runs`` lists: every run folder under a root, with its state and result."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from areal_core.cluster.jobs import RunJobs


@dataclass(frozen=True)
class RunEntry:
    folder: str
    name: str
    state: str  # "finished"; "unfinished, checkpoint vN" (running, or stopped: --resume continues it)
    steps: str  # done / asked
    accuracy: str  # held-out before -> after (finished runs)
    jobs: str = ""  # the Slurm jobs it submitted, by role (cluster: slurm): "trainer 12, rollout 13, reward 14 15"


def _versions(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    found = (
        [int(m.group(1)) for p in ckpt.glob("v*") if (m := re.fullmatch(r"v(\d+)", p.name))] if ckpt.is_dir() else []
    )
    return sorted(v for v in found if (ckpt / f"v{v}" / "manifest.json").is_file())


def describe(run_dir: Path) -> RunEntry | None:
    """A run folder's entry (None: not a run folder, i.e. no config.json)."""
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError:
        return RunEntry(str(run_dir), "?", "config.json unreadable", "", "")
    asked = (cfg.get("trainer") or {}).get("max_steps", "?")
    try:
        jobs = RunJobs(run_dir).summary()
    except ValueError as e:
        jobs = str(e)
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        return RunEntry(
            str(run_dir),
            cfg.get("name", "?"),
            "finished",
            f"{s['steps']} / {s['steps']}",
            f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}",
            jobs,
        )
    versions = _versions(run_dir)
    last = versions[-1] if versions else None
    state = f"unfinished, checkpoint v{last}" if last else "unfinished, no checkpoint yet"
    return RunEntry(str(run_dir), cfg.get("name", "?"), state, f"{last or 0} / {asked}", "", jobs)


def list_runs(root: str | Path) -> list[RunEntry]:
    """The run folders at most two levels under ``root`` (sweeps nest theirs), newest first."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder")
    found = [d for d in (*root.glob("*"), *root.glob("*/*")) if d.is_dir() and (d / "config.json").is_file()]
    found.sort(key=lambda d: (d / "config.json").stat().st_mtime, reverse=True)
    return [e for d in found if (e := describe(d)) is not None]
