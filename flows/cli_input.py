"""What every `areal-flow` subcommand shares: bad input as :class:`UsageError` (one `error:` line,
rc 2), and config loading that turns config errors into it."""

from __future__ import annotations


class UsageError(Exception):
    """Bad command-line input: printed as one `error:` line, rc 2."""


def _overrides(pairs: list[str]) -> dict:
    from areal_core.experiment import ConfigError, parse_overrides

    try:
        return parse_overrides(pairs)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _load(config: str, overrides: dict):
    from areal_core.experiment import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as e:
        raise UsageError(str(e)) from None
