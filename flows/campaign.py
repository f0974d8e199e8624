"""Prefect flow: provision -> prepare_data -> train (or sweep) -> evaluate final checkpoints -> report."""

from __future__ import annotations

import os

from prefect import flow

from areal_core.report.compare import eval_dir_for_run
from areal_core.run.sweep import default_out_dir
from areal_core.storage import CheckpointStore, read_json
from flows.evaluate import evaluate
from flows.prepare_data import prepare_data
from flows.provision import provision
from flows.report import report
from flows.sweep import sweep
from flows.train import train
from tasks.flow_runs import campaign_run_name


@flow(name="campaign", log_prints=True, flow_run_name=campaign_run_name)
def campaign(
    config_path: str = "configs/quickstart.yaml",
    out_dir: str | None = None,
    eta: list[int] | None = None,
    objective: list[str] | None = None,
    grid: dict[str, list] | None = None,
    max_steps: int | None = None,
    overrides: dict | None = None,
    data_source: str | None = None,
    data_path: str | None = None,
    eval_source: str | None = None,
    eval_path: str | None = None,
    benches: list[str] | None = None,
    eval_limit: int | None = None,
    evaluate_every: int | None = 0,
    s3_credentials_block: str | None = None,
    cache_dir: str | None = None,
) -> dict:
    """provision -> prepare data -> one training run (or a sweep) -> evaluate each final checkpoint -> report.

    Args:
        config_path: The YAML config to train (e.g. configs/quickstart.yaml).
        out_dir: The campaign's folder (data, runs, evaluations, report). None:
            runs/campaign-<name>-<date>-<time>.
        eta: Staleness bounds to sweep, e.g. [0, 4]: a sweep instead of one run.
        objective: Objectives to sweep, e.g. ["decoupled", "naive"]: a sweep instead of one run.
        grid: Other config keys to sweep, dotted, as JSON, e.g. {"trainer.optim.lr": [1e-4, 3e-5]}.
        max_steps: RL steps of every run. None: the config's trainer.max_steps.
        overrides: Config keys to change, dotted, as JSON, e.g. {"trainer.eta": 0, "seed": 1}.
        data_source: A dataset name (areal_core.data.sources, e.g. math_train) to train on.
            None: the config's data (a synthetic config's chain task is written out as records).
        data_path: Where data_source's file is, if not where the source expects it.
        eval_source: A dataset name for the held-out problems (e.g. math500).
        eval_path: Where eval_source's file is.
        benches: Benchmarks for the final checkpoints, e.g. ["humaneval"]. None: heldout, the
            run's own held-out split sampled as the run did.
        eval_limit: Score only the first N problems of each benchmark. None: all.
        evaluate_every: Intermediate checkpoints the evaluate deployment scores: k = every k-th
            version and the last; 0 = none (the default: the campaign scores the final ones itself).
        s3_credentials_block: A Prefect Secret block holding AWS_* variables for s3:// storage.
            None: the worker's environment.
        cache_dir: Where warm starts are cached. None: ~/.cache/areal-flow.
    """
    from areal_core.experiment import load_config  # torch: imported when the flow runs, not when deployed

    overrides = dict(overrides or {})
    cfg = load_config(config_path, overrides)
    out_dir = out_dir or default_out_dir(cfg.name, "campaign")
    if data_source and not eval_source and cfg.data.eval_dataset is None:
        raise ValueError("data_source needs held-out problems: give eval_source (or data.eval_dataset in the config)")
    provision(config_path, os.path.join(out_dir, "provision"), overrides, s3_credentials_block)

    data_url = os.path.abspath(os.path.join(out_dir, "data"))  # config paths resolve against the config's folder
    if data_source:
        m = prepare_data(data_source, os.path.join(data_url, "train"), path=data_path)
        overrides["data.dataset"] = m["files"][data_source]
    elif cfg.data.dataset == "synthetic":
        m = prepare_data("synthetic", data_url, synthetic=cfg.data.synthetic.model_dump())
        overrides["data.dataset"], overrides["data.eval_dataset"] = m["files"]["train"], m["files"]["eval"]
    if eval_source:
        m = prepare_data(eval_source, os.path.join(data_url, "eval"), path=eval_path)
        overrides["data.eval_dataset"] = m["files"][eval_source]
    load_config(config_path, overrides)  # the config still validates with the prepared files

    if eta or objective or grid:
        s = sweep(
            config_path,
            eta=eta or [],
            objective=objective or [],
            grid=grid,
            max_steps=max_steps,
            out_dir=out_dir,
            overrides=overrides,
            evaluate_every=evaluate_every,
            make_report=False,
            cache_dir=cache_dir,
        )  # credentials: already in this process's environment (provision)
        run_dirs = s["run_dirs"]
    else:
        run_dirs = [os.path.join(out_dir, cfg.name)]
        train(config_path, run_dirs[0], max_steps, overrides, evaluate_every, cache_dir=cache_dir)

    evaluations = {}
    for run_dir in run_dirs:
        summary = read_json(os.path.join(run_dir, "summary.json"))
        version = summary["final_version"]
        ckpt = CheckpointStore(summary["checkpoints"]).version_url(version)
        evaluations[run_dir] = evaluate(
            ckpt, benches, eval_dir_for_run(run_dir, version), version=version, limit=eval_limit, run_dir=run_dir
        )
    report_path = report(run_dirs, out_dir, title=f"campaign {cfg.name}")
    return {"out_dir": out_dir, "run_dirs": run_dirs, "evaluations": evaluations, "report": report_path}
