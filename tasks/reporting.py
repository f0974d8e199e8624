"""Prefect task: the comparison report over finished runs."""

from __future__ import annotations

from prefect import task

from areal_core.report.compare import write_report


@task(name="write-report")
def write_report_task(run_dirs: list[str], out_dir: str, title: str = "areal-flow report") -> dict:
    return write_report(run_dirs, out_dir, title=title)
