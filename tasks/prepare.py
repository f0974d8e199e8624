"""Prefect task: validate a data source and write its records to object storage."""

from __future__ import annotations

from prefect import task


@task(name="prepare-records")
def prepare_records(
    source: str, out_url: str, path: str | None = None, synthetic: dict | None = None, fmt: str = "parquet"
) -> dict:
    from areal_core.data.prepare import prepare  # heavy imports: only when the task runs

    return prepare(source, out_url, path=path, synthetic=synthetic, fmt=fmt)
