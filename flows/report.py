"""Prefect flow: the comparison report over finished runs (markdown + CSV + PNG plots), as artifacts too:
the runs' table (rounded) and the report with its plots inside it."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.flow_runs import report_run_name
from tasks.reporting import write_report_task

TABLE_COLUMNS = ("run", "eta", "objective", "accuracy_before", "final_accuracy", "accuracy_gain",
                 "effective_train_tokens_per_s", "wall_time_s", "max_staleness_observed", "ledger_ok")


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
    from areal_core.report_ui import inline_plots, rounded_rows

    out = write_report_task(run_dirs, out_dir, title)
    rows = [{k: r[k] for k in TABLE_COLUMNS} for r in out["table"]]  # every column: report.csv
    create_table_artifact(rounded_rows(rows), key="report-runs", description=f"runs compared in {out['report']}")
    create_markdown_artifact(inline_plots(out["markdown"], out["png"]), key="report", description=out["report"])
    print(f"report: {out['report']}")
    return out["report"]


if __name__ == "__main__":
    report(["runs/quickstart"], "runs/quickstart/report")
