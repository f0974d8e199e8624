"""The experiment config: one typed object composed of the components' own sections.

``load_config(path)`` reads YAML and fails before anything starts, naming the file,
line, key and what was expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from areal_core.cluster.config import ClusterConfig, LocalClusterConfig, settle_rollout, settle_trainer
from areal_core.configbase import Section
from areal_core.controller.agents import MultiAgentConfig
from areal_core.data.config import DataConfig
from areal_core.episodes.config import EpisodeConfig, SingleTurnConfig
from areal_core.models.config import ModelConfig
from areal_core.reward.config import RewardConfig
from areal_core.rollout.config import RolloutConfig
from areal_core.storage.config import StorageConfig
from areal_core.trainer.config import TrainerConfig

BUILTIN_MODELS = ("tiny", "smollm2-135m")


class ConfigError(ValueError):
    """A config that cannot run; the message names file, line, key and expectation."""


class EvalConfig(Section):
    """The held-out evaluation a run makes before and after RL."""

    n_problems: int = Field(500, gt=0)  # held-out problems for accuracy_before / accuracy_after
    temperature: float = Field(0.0, ge=0)  # 0: greedy
    max_new_tokens: int | None = Field(None, gt=0)  # default: rollout.sampling.max_new_tokens


class DevicePrices(Section):
    rollout: float = Field(ge=0)  # USD per device-hour of a rollout server
    trainer: float = Field(ge=0)  # USD per device-hour of the trainer


class CostConfig(Section):
    """Prices and a budget for the cost ledger (``run/costs.py``)."""

    # prices per device-hour; None: the ledger counts time and tokens, not money
    usd_per_device_hour: DevicePrices | None = None
    # stop cleanly (checkpointed, resumable) once the run has cost this much; needs the prices
    budget_usd: float | None = Field(None, gt=0)
    trainer_devices: int = Field(1, gt=0)  # devices the trainer holds (the rollout pool: its servers)

    @model_validator(mode="after")
    def _budget_needs_prices(self):
        if self.budget_usd is not None and self.usd_per_device_hour is None:
            raise ValueError(
                "cost.budget_usd needs cost.usd_per_device_hour: {rollout: X, trainer: Y} to price the run"
            )
        return self


class ExperimentConfig(Section):
    """One run's whole config: the components' sections, checked against each other."""

    name: str = "experiment"  # the run's name: in its folder's name, its logs and reports
    # seeds the model's init and warm start, the prompt order and the sampling (the data: data.synthetic.seed)
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    reward: RewardConfig = RewardConfig()
    storage: StorageConfig = StorageConfig()
    eval: EvalConfig = EvalConfig()
    episode: EpisodeConfig = SingleTurnConfig()  # what one rollout of a prompt group is (areal_core/episodes)
    # several agents, reward-gated routing (areal_core/controller/agents.py); None: one policy, no agents
    multi_agent: MultiAgentConfig | None = None
    cost: CostConfig = CostConfig()  # prices and a budget for the cost ledger (areal_core/run/costs.py)
    # where the pools run: {kind: local} (this machine, the default) or {kind: slurm, ...}: the rollout
    # servers, reward workers and (areal-flow train --cluster slurm) the trainer as Slurm jobs
    # (areal_core/cluster, docs/how-to/slurm.md)
    cluster: ClusterConfig = LocalClusterConfig()

    @model_validator(mode="after")
    def _cross_checks(self):
        t, r = self.trainer, self.rollout
        if t.batch_size % r.n_samples:
            raise ValueError(
                f"trainer.batch_size ({t.batch_size}) must be a multiple of "
                f"rollout.n_samples ({r.n_samples}): each step trains whole groups of answers"
            )
        if t.batch_size % t.ppo_minibatches:
            raise ValueError(
                f"trainer.batch_size ({t.batch_size}) must be divisible by "
                f"trainer.ppo_minibatches ({t.ppo_minibatches})"
            )
        per_mb = t.batch_size // t.ppo_minibatches
        if t.microbatching == "fixed" and per_mb < t.n_microbatches:
            raise ValueError(
                f"trainer.n_microbatches ({t.n_microbatches}) exceeds the trajectories per PPO minibatch ({per_mb})"
            )
        if t.microbatching == "dynamic" and t.max_tokens_per_microbatch < r.sampling.max_new_tokens + 1:
            raise ValueError(
                f"trainer.max_tokens_per_microbatch ({t.max_tokens_per_microbatch}) must hold a whole trajectory, "
                f"at least 1 prompt token + rollout.sampling.max_new_tokens ({r.sampling.max_new_tokens}) = "
                f"{r.sampling.max_new_tokens + 1} tokens"
            )
        if r.sampling.temperature == 0:
            raise ValueError(
                "rollout.sampling.temperature must be > 0 for RL (behaviour logprobs need a proper distribution)"
            )
        if t.optim.continue_warm_start and (self.model.name != "tiny" or self.model.warm_start.steps == 0):
            raise ValueError(
                "trainer.optim.continue_warm_start needs the tiny model with a warm start "
                "(model.name: tiny, model.warm_start.steps > 0)"
            )
        if t.lora is not None and t.backend.kind != "torch":
            raise ValueError(
                f"trainer.lora: LoRA trains on the torch trainer only; trainer.backend.kind is "
                f"{t.backend.kind!r} (set it to torch, or remove trainer.lora for full fine-tuning)"
            )
        if t.lora is not None and t.optim.continue_warm_start:
            raise ValueError(
                "trainer.optim.continue_warm_start continues the full model's AdamW moments; with "
                "trainer.lora only the adapters train (remove one of the two)"
            )
        settle_rollout(self.cluster, r)
        settle_trainer(self.cluster, t)
        ma = self.multi_agent
        if r.deterministic is None:  # a synchronous run repeats unless asked not to (rollout/config.py)
            r.deterministic = t.eta == 0 and r.backend.kind == "embedded" and ma is None
        if r.batch_invariant is None:
            r.batch_invariant = r.deterministic
        if r.deterministic and not (r.batch_invariant and r.backend.kind == "embedded" and ma is None):
            raise ValueError(
                "rollout.deterministic repeats runs only where each answer's arithmetic is its own: it "
                "needs rollout.batch_invariant: true on embedded servers, and no multi_agent"
            )
        if ma is not None and ma.needs_frozen_server:
            if r.backend.kind != "embedded":
                raise ValueError(
                    f"multi_agent: agents routed to the frozen policy run on an embedded server of "
                    f"their own, so rollout.backend.kind must be embedded (got {r.backend.kind!r}); "
                    f"or set multi_agent.top_k to the number of agents ({len(ma.agents)})"
                )
            if self.storage.keep_last is not None:
                raise ValueError(
                    "multi_agent: the frozen policy is checkpoint v0, which storage.keep_last would "
                    "prune; leave storage.keep_last unset"
                )
        cur = self.data.curriculum
        if cur is not None and self.data.dataset == "synthetic":
            field = "op" if self.data.synthetic.kind == "arith" else "k"
            if cur.by != field:
                what = {"op": "the kind of question", "k": "the chain length or argument count"}[field]
                raise ValueError(
                    f"data.curriculum.by: the {self.data.synthetic.kind} task's records are grouped by "
                    f"{field!r} ({what}); got {cur.by!r}"
                )
        return self


def _check_paths(data: dict, source: Path, places: dict[tuple, str], overrides: dict[str, Any] | None) -> None:
    """Missing models or datasets fail first, before any other check and before anything starts
    (read from the raw config: the other checks would only distract from a wrong path). Relative
    paths are relative to the folder of the config named on the command line."""
    base = source.parent

    def where(*key: str) -> str:
        dotted = ".".join(key)
        if overrides and dotted in overrides:
            return f"--set {dotted}={_as_yaml(overrides[dotted])}"
        return places.get(key, str(source))

    model, dataset = data.get("model") or {}, data.get("data") or {}
    m = model.get("name") if isinstance(model, dict) else None
    if isinstance(m, str) and m not in BUILTIN_MODELS and "://" not in m:
        p = (base / m) if not os.path.isabs(m) else Path(m)
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"{where('model', 'name')}: model.name: '{m}' is neither a built-in model {BUILTIN_MODELS} nor an "
                f"HF model folder (no config.json at {p})"
            )
    for key in ("dataset", "eval_dataset"):
        d = dataset.get(key) if isinstance(dataset, dict) else None
        if not isinstance(d, str) or d == "synthetic" or "://" in d:
            continue
        p = (base / d) if not os.path.isabs(d) else Path(d)
        if not p.is_file():
            raise ConfigError(f"{where('data', key)}: data.{key}: dataset file '{d}' not found (looked at {p})")


def _key_lines(text: str) -> dict[tuple, int]:
    """Map each key path (tuple) in a YAML document to its 1-based line."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                kp = path + (k.value,)
                lines[kp] = k.start_mark.line + 1
                walk(v, kp)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    try:
        walk(yaml.compose(text), ())
    except yaml.YAMLError:
        pass
    return lines


def _as_yaml(value: Any) -> str:
    """A value as one would write it after ``--set KEY=`` (YAML flow style, one line)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...")


def _key_places(text: str, source: str) -> dict[tuple, str]:
    """Each key path of a YAML document as ``source:line``."""
    return {k: f"{source}:{n}" for k, n in _key_lines(text).items()}


def format_validation_error(
    err: ValidationError, source: str, places: dict[tuple, str], overrides: dict[str, Any] | None = None
) -> str:
    """One line per error, each blaming where its value came from: the ``file:line`` in ``places``
    (a key path's file and line; with ``extends:``, the file that set it) or the ``--set KEY=VALUE``
    that overrode it."""
    msgs = []
    set_at = {tuple(k.split(".")): k for k in overrides or {}}
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-")))
        key = ".".join(str(x) for x in loc) or "(top level)"
        place = setter = None
        for n in range(len(loc), 0, -1):
            if loc[:n] in set_at:
                setter = set_at[loc[:n]]
                break
            if loc[:n] in places:
                place = places[loc[:n]]
                break
        where = f"--set {setter}={_as_yaml(overrides[setter])}" if setter else place or source
        typ, msg = e["type"], e["msg"]
        if typ == "extra_forbidden":
            msg = "unknown key"
            parent = _section_at(loc[:-1])
            if parent is not None:
                msg += f"; expected one of: {', '.join(sorted(parent.model_fields))}"
        elif "input" in e and typ not in ("missing",) and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        msgs.append(f"{where}: {key}: {msg}")
    return "invalid config:\n  " + "\n  ".join(msgs)


def _section_at(loc: tuple):
    cls: Any = ExperimentConfig
    for part in loc:
        f = getattr(cls, "model_fields", {}).get(part)
        if f is None:
            return None
        cls = f.annotation
    return cls if hasattr(cls, "model_fields") else None


def parse_config(
    data: dict, source: str = "<config>", text: str = "", overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    return _validate(data, source, _key_places(text, source), overrides)


def _validate(data, source: str, places: dict[tuple, str], overrides: dict[str, Any] | None) -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of config sections at the top level, got {type(data).__name__}"
        )
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, places, overrides)) from None


def upgraded_config(saved: dict) -> dict:
    """A saved run's config (config.json, a checkpoint's) as this areal-flow reads it: keys added since
    take their defaults. Raises a ValueError for one that is no longer valid."""
    return ExperimentConfig.model_validate(saved).model_dump(mode="json")


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys (``trainer.eta``) in a raw config mapping; returns a new mapping."""
    import copy

    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: '{p}' is not a section")
        node[parts[-1]] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> tuple[Any, dict[tuple, str]]:
    """A config file's mapping and the ``file:line`` of each key, with ``extends: BASE`` resolved: BASE
    (a path relative to this file) is read first and this file's keys are merged into it, section by
    section (a mapping merges into a mapping; anything else replaces). Each key keeps the place of the
    file that set it, so errors blame the right file and line."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (extended by {chain[-1]})" if chain else ""))
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    places = _key_places(text, str(path))
    if not isinstance(data, dict) or "extends" not in data:
        return data, places
    base = data.pop("extends")
    where = places.pop(("extends",), str(path))
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{where}: extends: expected the path of the config file this one builds on, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in chain + (path.resolve(),):
        raise ConfigError(f"{where}: extends: {base} leads back to itself ({' -> '.join(map(str, chain + (path,)))})")
    base_data, base_places = _read_yaml(base_path, chain + (path.resolve(),))
    if not isinstance(base_data, dict):
        raise ConfigError(f"{base_path}: expected a mapping of config sections at the top level (extended by {path})")
    return _merge(base_data, data), {**base_places, **places}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    path = Path(path)
    data, places = _read_yaml(path)
    if overrides:
        data = apply_overrides(data, overrides)
    if isinstance(data, dict):
        _check_paths(data, path, places, overrides)
        data = _paths_from(data, path.parent)
    return _validate(data, str(path), places, overrides)


def _paths_from(data: dict, base: Path) -> dict:
    """``data`` with a relative model folder or dataset file made absolute against ``base`` (the
    config's folder, where ``_check_paths`` found them), so a run reads them wherever it starts."""
    model = dict(data["model"]) if isinstance(data.get("model"), dict) else {}
    dataset = dict(data["data"]) if isinstance(data.get("data"), dict) else {}
    m = model.get("name")
    if isinstance(m, str) and m not in BUILTIN_MODELS and "://" not in m and not os.path.isabs(m):
        model["name"] = str((base / m).resolve())
    for key in ("dataset", "eval_dataset"):
        d = dataset.get(key)
        if isinstance(d, str) and d != "synthetic" and "://" not in d and not os.path.isabs(d):
            dataset[key] = str((base / d).resolve())
    return {**data, **({"model": model} if model else {}), **({"data": dataset} if dataset else {})}


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as a dict of dotted keys to YAML-parsed values."""
    out = {}
    for p in pairs:
        if "=" not in p:
            raise ConfigError(f"--set expects KEY=VALUE (e.g. trainer.eta=4), got {p!r}")
        k, v = p.split("=", 1)
        value = yaml.safe_load(v)
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value):  # YAML 1.1 reads 1e-5 as text
            value = float(value)
        out[k] = value
    return out


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
