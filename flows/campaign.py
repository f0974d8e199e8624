"""Prefect flow: provision -> prepare_data -> train every setting on paired seeds (more while a
difference is unclear, ``areal_core/run/campaign.py``) -> decide -> evaluate final checkpoints -> report."""

from __future__ import annotations

import os

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from areal_core.report.compare import eval_dir_for_run
from areal_core.report.decision import write_decision_report
from areal_core.run.campaign import CampaignPlan, run_campaign, run_dir_of
from areal_core.run.decide import Budget
from areal_core.run.sweep import default_out_dir, freeze_config, named_points, sweep_points
from areal_core.storage import CheckpointStore, read_json
from flows.evaluate import evaluate
from flows.prepare_data import prepare_data
from flows.provision import provision
from flows.report import report
from flows.train import train
from tasks.flow_runs import artifact_key, campaign_run_name


@flow(name="campaign", log_prints=True, flow_run_name=campaign_run_name)
def campaign(
    config_path: str = "configs/quickstart.yaml",
    out_dir: str | None = None,
    eta: list[int] | None = None,
    objective: list[str] | None = None,
    grid: dict[str, list] | None = None,
    settings: dict[str, dict] | None = None,
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
    seeds: int = 1,
    baseline: str | None = None,
    until_clear: bool = False,
    max_seeds: int = 10,
    max_runs: int | None = None,
    max_minutes: float | None = None,
    margin: float = 0.02,
    outcome: str = "accuracy_after",
    keep_run_state: bool = False,
) -> dict:
    """provision -> prepare data -> every setting (of the grid, or named) on paired seeds -> decide -> evaluate
    each final checkpoint -> report. Runs go to ``out_dir/<setting>-s<seed>``; a campaign started
    again over the same folder reuses the finished runs of the same config and code, and the
    evaluations of their final checkpoints.

    Args:
        config_path: The YAML config to train (e.g. configs/quickstart.yaml).
        out_dir: The campaign's folder (data, runs, evaluations, report). None:
            runs/campaign-<name>-<date>-<time>.
        eta: Staleness bounds to sweep, e.g. [0, 4]: a sweep instead of one run.
        objective: Objectives to sweep, e.g. ["decoupled", "naive"]: a sweep instead of one run.
        grid: Other config keys to sweep, dotted, as JSON, e.g. {"trainer.optim.lr": [1e-4, 3e-5]}.
        settings: Named settings instead of a grid (an ablation's rows), as JSON, e.g.
            {"float32": {"model.dtype": "float32"}, "bf16-servers": {"model.dtype": "float32",
            "rollout.dtype": "bfloat16"}}: each label its config keys. Not with eta, objective or grid.
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
        seeds: Seeds every setting runs (0 .. seeds-1, the same in every setting: paired).
        baseline: The setting differences are taken to (a label such as eta0-decoupled). None: the first.
        until_clear: While a difference to the baseline is unclear (its 95 % interval neither
            excludes 0 nor lies within +-margin), add a seed of the baseline and of each unclear
            setting, up to the budget.
        max_seeds: With until_clear: at most this many seeds per setting.
        max_runs: With until_clear: at most this many runs in all. None: no limit.
        max_minutes: With until_clear: no new seed after this many minutes. None: no limit.
        margin: Differences within +-margin count as the same.
        outcome: What decides: accuracy_after (held-out accuracy after RL) or accuracy_gain.
        keep_run_state: Keep the optimizer state in the checkpoints of finished runs (to continue
            or replay them). False: dropped once a run finishes; the weights stay.
    """
    from areal_core.experiment import load_config  # torch: imported when the flow runs, not when deployed

    overrides = dict(overrides or {})
    cfg = load_config(config_path, overrides)
    out_dir = out_dir or default_out_dir(cfg.name, "campaign")
    if data_source and not eval_source and cfg.data.eval_dataset is None:
        raise ValueError("data_source needs held-out problems: give eval_source (or data.eval_dataset in the config)")
    provision(config_path, os.path.join(out_dir, "provision"), overrides, s3_credentials_block)

    overrides |= _prepare_campaign_data(
        cfg, os.path.join(out_dir, "data"), data_source, data_path, eval_source, eval_path
    )
    load_config(config_path, overrides)  # the config still validates with the prepared files

    if settings and (eta or objective or grid):
        raise ValueError("settings names every setting of the campaign: give it without eta, objective or grid")
    points = named_points(settings) if settings else sweep_points(eta, objective, grid, allow_empty=True)
    points = [(label or cfg.name, ov) for label, ov in points]
    frozen = freeze_config(config_path, os.path.join(out_dir, "config.yaml"), overrides)
    steps = {"trainer.max_steps": max_steps} if max_steps else {}
    budget = Budget(max_seeds, max_runs, max_minutes)
    plan = CampaignPlan(
        points, baseline or points[0][0], seeds, until_clear, budget, margin, outcome, keep_run_state=keep_run_state
    )

    def train_one(label: str, seed: int, ov: dict, run_dir, resume: bool) -> None:
        train.with_options(flow_run_name=f"train-{label}-s{seed}")(
            frozen, str(run_dir), None, {**ov, **steps}, evaluate_every, cache_dir=cache_dir, resume=resume
        )

    decision = run_campaign(
        plan,
        out_dir,
        lambda ov: load_config(frozen, {**ov, **steps}).model_dump(mode="json"),
        train_one,
        on_decision=lambda decision: _show_decision(out_dir, decision),
    )
    run_dirs = [str(run_dir_of(out_dir, s["label"], int(k))) for s in decision["settings"] for k in s["by_seed"]]

    evaluations = _evaluate_final_checkpoints(run_dirs, benches, eval_limit)
    report_path = report(run_dirs, out_dir, title=f"campaign {cfg.name}")
    return {
        "out_dir": out_dir,
        "run_dirs": run_dirs,
        "evaluations": evaluations,
        "report": report_path,
        "decision": decision,
    }


def _show_decision(out_dir: str, decision: dict) -> None:
    """After every seed: the decision's page and plots drawn again and a version of the UI artifact added
    (its newest version is where the campaign stands)."""
    create_markdown_artifact(
        write_decision_report(out_dir),
        key=artifact_key("decision", out_dir),
        description="the campaign's decision" if decision["final"] else "the campaign's decision so far",
    )
    print(f"the decision{'' if decision['final'] else ' so far'}: {os.path.join(out_dir, 'decision.md')}")


def _prepare_campaign_data(
    cfg, out_dir: str, data_source: str | None, data_path: str | None, eval_source: str | None, eval_path: str | None
) -> dict:
    """The data every run of the campaign trains and is scored on, prepared once into ``out_dir`` (the
    prepare-data flow): ``data_source`` / ``eval_source`` where given, else the config's synthetic
    problems where it has them; the config keys that point the runs at the files."""
    url = os.path.abspath(out_dir)  # config paths resolve against the config's folder
    keys = {}
    if data_source:
        m = prepare_data(data_source, os.path.join(url, "train"), path=data_path)
        keys["data.dataset"] = m["files"][data_source]
    elif cfg.data.dataset == "synthetic":
        m = prepare_data("synthetic", url, synthetic=cfg.data.synthetic.model_dump())
        keys["data.dataset"], keys["data.eval_dataset"] = m["files"]["train"], m["files"]["eval"]
    if eval_source:
        m = prepare_data(eval_source, os.path.join(url, "eval"), path=eval_path)
        keys["data.eval_dataset"] = m["files"][eval_source]
    return keys


def _evaluate_final_checkpoints(run_dirs: list[str], benches: list[str] | None, limit: int | None) -> dict:
    """Each run's last checkpoint evaluated (the evaluate flow, into the run's ``evals/vN``), by run folder;
    one scored so before, on the same benches and settings, is not scored again."""
    from areal_core.eval.harness import HELDOUT, earlier_evaluation

    evaluations = {}
    for run_dir in run_dirs:
        summary = read_json(os.path.join(run_dir, "summary.json"))
        version = summary["final_version"]
        out_dir = eval_dir_for_run(run_dir, version)
        earlier = earlier_evaluation(out_dir, benches or [HELDOUT], limit=limit)  # evaluate's other defaults
        if earlier is not None:
            print(f"{run_dir} v{version}: scored before ({out_dir}), not again")
            evaluations[run_dir] = earlier
            continue
        ckpt = CheckpointStore(summary["checkpoints"]).version_url(version)
        evaluations[run_dir] = evaluate(ckpt, benches, out_dir, version=version, limit=limit, run_dir=run_dir)
    return evaluations
