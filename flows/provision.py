"""Prefect flow: bring up or connect to the Dask cluster, object storage and rollout servers, and verify them."""

from __future__ import annotations

from prefect import flow

from tasks.provision import apply_s3_credentials_block, provision_check


@flow(name="provision", log_prints=True)
def provision(config_path: str = "configs/quickstart.yaml", out_dir: str = "runs/provision",
              overrides: dict | None = None, s3_credentials_block: str | None = None) -> dict:
    """``s3_credentials_block``: a Prefect Secret block holding AWS_* variables (else: the environment)."""
    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    report = provision_check(config_path, out_dir, overrides)
    print(f"dask: {report['dask']['scheduler']}  storage: {report['storage']['url']}  "
          f"rollout: {report['rollout']['backend']}")
    return report


if __name__ == "__main__":
    provision()
