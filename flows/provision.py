"""Prefect flow: bring up or connect to the Dask cluster, object storage and rollout servers, and verify them."""

from __future__ import annotations

from prefect import flow

from tasks.flow_runs import provision_run_name
from tasks.provision import apply_s3_credentials_block, provision_check


@flow(name="provision", log_prints=True, flow_run_name=provision_run_name)
def provision(
    config_path: str = "configs/quickstart.yaml",
    out_dir: str = "runs/provision",
    overrides: dict | None = None,
    s3_credentials_block: str | None = None,
) -> dict:
    """Bring up or connect to what a config's runs need, and check each: the Dask cluster grades a known
    answer, object storage takes a probe object, external rollout servers answer /health.

    Args:
        config_path: The YAML config whose reward, storage and rollout sections are checked.
        out_dir: Where the provision report (provision.json) goes.
        overrides: Config keys to change, dotted, as JSON, e.g. {"reward.scheduler_address": "tcp://host:8786"}.
        s3_credentials_block: A Prefect Secret block holding AWS_* variables. None: the worker's environment.
    """
    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    report = provision_check(config_path, out_dir, overrides)
    print(
        f"dask: {report['dask']['scheduler']}  storage: {report['storage']['url']}  "
        f"rollout: {report['rollout']['backend']}"
    )
    return report
