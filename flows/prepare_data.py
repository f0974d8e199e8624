"""Prefect flow: turn a data source into validated records in object storage."""

from __future__ import annotations

from prefect import flow

from tasks.prepare import prepare_records


@flow(name="prepare-data", log_prints=True)
def prepare_data(source: str = "synthetic", out_url: str = "runs/data/synthetic", path: str | None = None,
                 synthetic: dict | None = None, fmt: str = "parquet") -> dict:
    """``source``: ``synthetic`` (the chain task, ``synthetic`` = its settings) or a dataset name
    read by ``areal_core.data.sources.read_source`` (``path`` overrides where its file is), e.g.
    ``livecodebench_train`` or ``leetcode_train``: code problems with their tests, less those
    that are also evaluation problems (listed in the manifest)."""
    manifest = prepare_records(source, out_url, path, synthetic, fmt)
    print(f"{source}: " + ", ".join(f"{k} {n} records -> {manifest['files'][k]}" for k, n in manifest["counts"].items()))
    left_out = manifest.get("left_out_as_evaluation_problems", [])
    if left_out:
        print(f"{source}: left out {len(left_out)} problem(s) that are also evaluation problems (see manifest.json)")
    return manifest


if __name__ == "__main__":
    prepare_data()
