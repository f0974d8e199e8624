"""Prefect flow: turn a data source into validated records in object storage."""

from __future__ import annotations

from prefect import flow

from tasks.flow_runs import prepare_data_run_name
from tasks.prepare import prepare_records


@flow(name="prepare-data", log_prints=True, flow_run_name=prepare_data_run_name)
def prepare_data(
    source: str = "synthetic",
    out_url: str = "runs/data/synthetic",
    path: str | None = None,
    synthetic: dict | None = None,
    fmt: str = "parquet",
) -> dict:
    """Turn a data source into validated records; every row is checked before anything is written,
    ``manifest.json`` last.

    Args:
        source: synthetic (the chain task) or a dataset name read by
            areal_core.data.sources.read_source, e.g. math_train, livecodebench_train or
            leetcode_train (code problems with their tests, less those that are also evaluation
            problems, listed in the manifest).
        out_url: Where the records go: a folder or an s3:// URL.
        path: Where the source's file is, if not where the source expects it.
        synthetic: The chain task's settings for source: synthetic, as JSON, e.g.
            {"n_train": 20000, "n_eval": 500, "max_chain": 12}.
        fmt: parquet or jsonl.
    """
    manifest = prepare_records(source, out_url, path, synthetic, fmt)
    print(
        f"{source}: " + ", ".join(f"{k} {n} records -> {manifest['files'][k]}" for k, n in manifest["counts"].items())
    )
    left_out = manifest.get("left_out_as_evaluation_problems", [])
    if left_out:
        print(f"{source}: left out {len(left_out)} problem(s) that are also evaluation problems (see manifest.json)")
    return manifest
