"""Prefect flow: the comparison report over finished runs (markdown + CSV + PNG plots), as artifacts too:
the runs' table (rounded) and the report with its plots inside it."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.flow_runs import report_run_name
from tasks.reporting import write_report_task


@flow(name="report", log_prints=True, flow_run_name=report_run_name)
def report(run_dirs: list[str], out_dir: str, title: str = "areal-flow report") -> str:
    """Compare finished runs: a table, the checkpoint evaluations, and plots of learning curves,
    accuracy, answer lengths, staleness and throughput.

    Args:
        run_dirs: The run folders to compare (local or s3://), e.g. ["runs/sweep-x/eta0-decoupled",
            "runs/sweep-x/eta4-decoupled"].
        out_dir: Where report.md, report.csv and the plots go.
        title: The report's title.
    """
    from areal_core.report.ui import report_for_ui, runs_rows

    out = write_report_task(run_dirs, out_dir, title)
    header, rows = runs_rows(out["table"])  # every column, unrounded: report.csv
    create_table_artifact(
        [dict(zip(header, r)) for r in rows], key="report-runs", description=f"runs compared in {out['report']}"
    )
    create_markdown_artifact(
        report_for_ui(out["markdown"], out["table"], out["png"]), key="report", description=out["report"]
    )
    print(f"report: {out['report']}")
    return out["report"]
