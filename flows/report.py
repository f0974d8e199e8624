"""Prefect flow: the comparison report over finished runs (markdown + CSV + PNG plots), as artifacts too."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.reporting import write_report_task


@flow(name="report", log_prints=True)
def report(run_dirs: list[str], out_dir: str, title: str = "areal-flow report") -> str:
    out = write_report_task(run_dirs, out_dir, title)
    create_table_artifact(out["table"], key="report-runs", description=f"runs compared in {out['report']}")
    plots = "\n".join(f"* {name}: `{url}`" for name, url in out["plots"].items())
    # the UI cannot show local PNG files: the markdown artifact links them by path
    create_markdown_artifact(out["markdown"].split("## Learning curve")[0] + "## Plots\n\n" + plots,
                             key="report", description=out["report"])
    print(f"report: {out['report']}")
    return out["report"]


if __name__ == "__main__":
    report(["runs/quickstart"], "runs/quickstart/report")
