"""Prefect tasks: S3 credentials from a Prefect block, and the provision checks."""

from __future__ import annotations

import os

from prefect import task
from prefect.blocks.system import Secret

S3_ENV_KEYS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
)


@task(name="s3-credentials-from-block")
def apply_s3_credentials_block(block_name: str) -> list[str]:
    """Copy S3 settings from a Prefect Secret block (a JSON object of AWS_* variables)
    into this process's environment; runs and rollout servers started here inherit them."""
    value = Secret.load(block_name).get()
    if not isinstance(value, dict):
        raise ValueError(f"Secret block {block_name!r} must hold a JSON object of AWS_* variables")
    unknown = sorted(set(value) - set(S3_ENV_KEYS))
    if unknown:
        raise ValueError(f"Secret block {block_name!r}: unknown keys {unknown}; expected some of {S3_ENV_KEYS}")
    for k, v in value.items():
        os.environ[k] = str(v)
    return sorted(value)  # the names only: never log the values


@task(name="provision-check")
def provision_check(config_path: str, out_dir: str, overrides: dict | None = None) -> dict:
    from areal_core.experiment import load_config  # heavy imports: only when the task runs
    from areal_core.ops.provision import provision

    return provision(load_config(config_path, overrides or {}), out_dir)
