"""A sweep grid: the cartesian product over eta, objective and any other config keys."""

from __future__ import annotations

import itertools
import os
import re
from datetime import datetime
from pathlib import Path


def _slug(v) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", str(v)).strip("_")


_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def named_points(settings: dict[str, dict]) -> list[tuple[str, dict]]:
    """``[(label, overrides)]`` for settings given by name (an ablation's rows, which no grid of
    independent keys makes), in the order given. A label names the runs' folders, so it is letters,
    digits, ``.``, ``_`` and ``-``; each setting is a non-empty mapping of dotted config keys."""
    if not settings:
        raise ValueError("settings: expected at least one named setting, e.g. {'float32': {'model.dtype': 'float32'}}")
    points = []
    for label, ov in settings.items():
        if not isinstance(label, str) or not _LABEL.match(label):
            raise ValueError(
                f"setting label {label!r}: expected letters, digits, '.', '_' and '-' (it names the runs' folders)"
            )
        if not isinstance(ov, dict) or not ov or not all(isinstance(k, str) for k in ov):
            raise ValueError(
                f"setting {label!r}: expected a mapping of dotted config keys to values, e.g. "
                f"{{'model.dtype': 'float32'}}, got {ov!r}"
            )
        points.append((label, dict(ov)))
    return points


def sweep_points(
    eta: list[int] | None = None,
    objective: list[str] | None = None,
    grid: dict[str, list] | None = None,
    allow_empty: bool = False,
) -> list[tuple[str, dict]]:
    """``[(label, overrides)]``, one per grid point; label like ``eta0-decoupled`` (+ ``key=value``).
    No axis at all: an error, or with ``allow_empty`` the one point ``("", {})`` (the config as it is)."""
    axes: dict[str, list] = {}
    if eta:
        axes["trainer.eta"] = list(eta)
    if objective:
        axes["trainer.objective"] = list(objective)
    for k, vals in (grid or {}).items():
        if k in axes:
            raise ValueError(f"sweep key {k} given twice")
        if not isinstance(vals, list) or not vals:
            raise ValueError(f"sweep key {k}: expected a non-empty list of values, got {vals!r}")
        axes[k] = vals
    if not axes:
        if allow_empty:
            return [("", {})]
        raise ValueError("empty sweep: give eta, objective or grid values")
    points = []
    for combo in itertools.product(*axes.values()):
        ov = dict(zip(axes, combo))
        parts = []
        for k, v in ov.items():
            if k == "trainer.eta":
                parts.append(f"eta{v}")
            elif k == "trainer.objective":
                parts.append(str(v))
            else:
                parts.append(f"{k.rsplit('.', 1)[-1]}{_slug(v)}")
        points.append(("-".join(parts), ov))
    return points


def plan_points(
    eta: list[int] | None, objective: list[str] | None, grid: dict[str, list] | None, n_configs: int = 1
) -> list[tuple[str, dict]]:
    """The sweep's points with its defaults: eta or objective not given (None) sweeps eta 0,4 or both
    objectives for one config, and keeps each config's own for several (with no axis at all: one run
    per config as it is)."""
    several = n_configs > 1
    return sweep_points(
        eta if eta is not None else ([] if several else [0, 4]),
        objective if objective is not None else ([] if several else ["decoupled", "naive"]),
        grid,
        allow_empty=several,
    )


def validate_points(config_path: str, points: list[tuple[str, dict]], base: dict | None = None) -> str:
    """Load the config for every point (ConfigError on the first bad one); return the config's name."""
    from areal_core.experiment import load_config  # imports torch (model configs): only when needed

    name = ""
    for _, ov in points:
        name = load_config(config_path, {**(base or {}), **ov}).name
    return name


def validate_configs(config_paths: list[str], points: list[tuple[str, dict]], base: dict | None = None) -> list[str]:
    """``validate_points`` for each config; their names, which must differ (they label the runs)."""
    names = [validate_points(p, points, base) for p in config_paths]
    if len(set(names)) != len(names):
        raise ValueError(f"the configs' names label the runs, so they must differ: {names}")
    return names


def freeze_config(config_path: str, dest: str, base: dict | None = None) -> str:
    """Write the validated config (``base`` overrides applied, every key explicit) to ``dest``.

    Every run of a sweep loads this copy, so an edit of the original file while the
    sweep runs cannot change its later runs. Relative model/dataset paths are made
    absolute against the original config's folder (where the loader checked them).
    """
    import yaml

    from areal_core.experiment import BUILTIN_MODELS, load_config
    from areal_core.storage.fsutil import write_text_atomic

    cfg = load_config(config_path, base or {}).model_dump(mode="json")
    folder = Path(config_path).resolve().parent

    def absolute(p: str) -> str:
        if "://" in p or os.path.isabs(p):
            return p
        for cand in (folder / p, Path.cwd() / p):
            if cand.exists():
                return str(cand)
        return p

    if cfg["model"]["name"] not in BUILTIN_MODELS:
        cfg["model"]["name"] = absolute(cfg["model"]["name"])
    for key in ("dataset", "eval_dataset"):
        if cfg["data"][key] not in (None, "synthetic"):
            cfg["data"][key] = absolute(cfg["data"][key])
    write_text_atomic(dest, f"# frozen from {config_path} by the sweep\n" + yaml.safe_dump(cfg, sort_keys=False))
    return dest


def default_out_dir(name: str, kind: str = "sweep") -> str:
    return str(Path("runs") / f"{kind}-{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
