"""What every `areal-flow` subcommand shares: bad input as :class:`UsageError` (one `error:` line,
rc 2), config loading that turns config errors into it, and the argument types and options several
commands take. Nothing here imports Prefect or torch."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad command-line input: printed as one `error:` line, rc 2."""


def overrides_from(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as config overrides."""
    from areal_core.experiment import ConfigError, parse_overrides

    try:
        return parse_overrides(pairs)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def config_from(config: str, overrides: dict):
    """The experiment config at ``config`` with ``overrides``, validated."""
    from areal_core.experiment import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def csv_values(text: str, kind=str) -> list:
    return [kind(v) for v in text.split(",") if v.strip() != ""]


def int_list(text: str, flag: str) -> list[int]:
    try:
        return csv_values(text, int)
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated whole numbers, got {text!r}") from None


def grid_from(pairs: list[str]) -> dict[str, list]:
    """``--grid KEY=V1,V2`` pairs as ``{key: [values]}`` (each value read as YAML)."""
    import yaml

    out = {}
    for p in pairs:
        if "=" not in p:
            raise UsageError(f"--grid expects KEY=V1,V2 (e.g. trainer.optim.lr=1e-4,3e-5), got {p!r}")
        k, v = p.split("=", 1)
        out[k] = [yaml.safe_load(x) for x in v.split(",")]
    return out


def settings_from(pairs: list[str]) -> dict[str, dict]:
    """``--setting LABEL={KEY: VALUE, ...}`` pairs as ``{label: {key: value}}`` (the mapping read as YAML)."""
    import yaml

    out: dict[str, dict] = {}
    for p in pairs:
        label, sep, text = p.partition("=")
        try:
            value = yaml.safe_load(text) if sep else None
        except yaml.YAMLError:
            value = None
        if not label or not isinstance(value, dict) or not value:
            raise UsageError(
                f"--setting expects LABEL={{KEY: VALUE, ...}} (e.g. bf16-servers='{{model.dtype: float32, "
                f"rollout.dtype: bfloat16}}'), got {p!r}"
            )
        if label in out:
            raise UsageError(f"--setting {label} given twice")
        out[label] = value
    return out


def add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.eta=0 (repeatable)",
    )


def add_command(sub: argparse._SubParsersAction, name: str, help: str, func, description: str | None = None):
    """A subcommand: its one-line ``help`` is what ``areal-flow --help`` lists, ``description`` (default:
    the same line) what ``areal-flow NAME --help`` starts with; ``func(args) -> int`` runs it."""
    p = sub.add_parser(name, help=help, description=description or help)
    p.set_defaults(func=func, command_help=help)
    return p
