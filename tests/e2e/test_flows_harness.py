"""The Prefect flows on Prefect's test harness: the campaign end to end on a tiny config,
and the `areal-flow sweep` command (report path printed last)."""

import asyncio
import json
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.events.filters import EventFilter, EventNameFilter

from flows.campaign import campaign
from tasks.events import CHECKPOINT_EVENT

HERE = Path(__file__).resolve().parents[1]  # tests/
CONFIG = str(HERE / "data/campaign_tiny.yaml")


async def _flow_runs():
    async with get_client() as c:
        runs = await c.read_flow_runs(limit=200)
        flows = {f.id: f.name for f in await c.read_flows(limit=200)}
        return [(flows[r.flow_id], r) for r in runs]


async def _artifacts():
    async with get_client() as c:
        return await c.read_artifacts(limit=200)


async def _events(name: str):
    async with get_client() as c:
        page = await c.read_events(EventFilter(event=EventNameFilter(name=[name])), limit=50)
        return page.events


@pytest.mark.slow
@pytest.mark.nightly
def test_campaign_end_to_end(prefect_harness, tmp_path, warm_cache):
    out = tmp_path / "campaign"
    result = campaign(
        config_path=CONFIG, out_dir=str(out), max_steps=2, eval_limit=8, evaluate_every=1, cache_dir=warm_cache
    )
    run_dir = out / "tiny-s0"
    assert result["run_dirs"] == [str(run_dir)]
    assert result["decision"]["settings"][0]["verdict"] == "baseline" and (out / "decision.md").is_file()

    # prepare_data wrote validated records, and the run trained from them
    manifest = json.loads((out / "data/manifest.json").read_text())
    assert manifest["counts"] == {"train": 100, "eval": 40}
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["data"]["dataset"] == manifest["files"]["train"]
    assert cfg["data"]["eval_dataset"] == manifest["files"]["eval"]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_version"] == 2 and summary["ledger_check"]["ok"]
    # the finished run's checkpoints keep their weights, not its optimizer state
    held = json.loads((run_dir / "checkpoints/v2/manifest.json").read_text())
    paths = [e["path"] for e in held["files"]]
    assert (
        "model.safetensors" in paths
        and "resume/trainer.pt" not in paths
        and held["meta"]["dropped"] == ["resume/trainer.pt"]
    )

    # the final checkpoint was evaluated: per-problem parquet + summary
    ev = json.loads((run_dir / "evals/v2/summary.json").read_text())
    # by default on the run's own held-out split, with the run's sampling settings
    assert ev["benchmarks"]["heldout"]["n_problems"] == 8 and ev["run_dir"] == str(run_dir)
    assert len(pd.read_parquet(run_dir / "evals/v2/heldout/results.parquet")) == 8
    assert result["evaluations"][str(run_dir)]["benchmarks"]["heldout"]["n_problems"] == 8

    # the report, with the run and its evaluation
    assert result["report"] == str(out / "report.md")
    table = pd.read_csv(out / "report.csv")
    assert len(table) == 1 and table["steps"].item() == 2 and table["eta"].item() == 1
    assert (out / "evals.csv").exists() and (out / "learning_curve.png").stat().st_size > 5000

    # every stage ran as a Prefect flow run, and completed
    runs = asyncio.run(_flow_runs())
    by_flow = {}
    for name, r in runs:
        by_flow.setdefault(name, []).append(r)
    for name in ("campaign", "provision", "prepare-data", "train", "evaluate", "report"):
        assert name in by_flow, f"no {name} flow run"
        assert all(r.state.is_completed() for r in by_flow[name]), name
    campaign_run = by_flow["campaign"][0]
    assert all(r.parent_task_run_id is not None for r in by_flow["train"])  # subflows of the campaign

    # progress artifact at 100%, evaluation and report tables
    arts = asyncio.run(_artifacts())
    progress = [a for a in arts if a.type == "progress" and (a.key or "").startswith("train-progress-tiny-s0")]
    assert progress and float(progress[0].data) == pytest.approx(100.0)
    keys = {a.key for a in arts}
    # one evaluation artifact per run and version; the train run's result table
    assert {"evaluation-tiny-s0-v2", "report-runs", "report", "decision-campaign"} <= keys
    result_md = [a for a in arts if (a.key or "").startswith("train-result-tiny")]
    assert result_md and "held-out accuracy" in result_md[0].data and "| measure | value |" in result_md[0].data
    # the campaign's evaluation of v2 came after the run's result: it linked itself there (the artifact itself)
    evaluation = next(a for a in arts if a.key == "evaluation-tiny-s0-v2")
    assert f"/artifacts/artifact/{evaluation.id}): heldout pass@1" in result_md[0].data
    assert "- v1: evaluate-tiny-s0-v1: not scored yet" in result_md[0].data  # marked, but no deployment here
    curves = next(a for a in arts if a.key == "train-curves-tiny-s0")
    assert "![learning curves of tiny](data:image/png;base64," in curves.data and "step 2 of 2" in curves.data
    assert "](data:image/png;base64," in evaluation.data and "pass@1" in evaluation.data
    costs = next(a for a in arts if (a.key or "").startswith("train-costs-tiny"))  # the cost ledger, stacked
    assert "![seconds per step by stage](data:image/png;base64," in costs.data and "| trainer training |" in costs.data
    report_md = next(a for a in arts if a.key == "report")
    assert report_md.data.count("](data:image/png;base64,") == 5  # the report's plots, inside it

    # one checkpoint event per published version (v0, v1, v2), with URL and version, marked for evaluation
    deadline = time.monotonic() + 30
    events = []
    while time.monotonic() < deadline:
        events = [e for e in asyncio.run(_events(CHECKPOINT_EVENT)) if e.resource["areal.run_dir"] == str(run_dir)]
        if len(events) >= 3:
            break
        time.sleep(1)
    by_version = {e.payload["version"]: e for e in events}
    assert sorted(by_version) == [0, 1, 2]
    assert by_version[2].payload["url"] == str(run_dir / "checkpoints/v2")
    assert by_version[2].payload["eval_dir"] == str(run_dir / "evals/v2") and by_version[2].payload["final"]
    assert [by_version[v].resource["areal.evaluate"] for v in (0, 1, 2)] == ["false", "true", "true"]
    assert by_version[1].resource.id == f"areal.run.{run_dir}"
    assert campaign_run.state.is_completed()


@pytest.mark.slow
@pytest.mark.nightly
def test_a_campaign_adds_seeds_until_clear_and_resumes_without_training_again(
    prefect_harness, tmp_path, capsys, warm_cache, monkeypatch
):
    """areal-flow campaign --until-clear on the tiny config: eta 0 against eta 1 and eta 1 naive, paired
    seeds, a seed more of the baseline and each setting still unclear (at most 3); the decision's
    intervals in the file and in the UI artifact; the same command again trains nothing."""
    import areal_core.run.campaign as campaign_module
    import areal_core.run.setup as setup_module
    from areal_core.run.decide import compare
    from areal_core.run.folder import code_version
    from flows.cli import main

    code = code_version()  # the code as the test starts: a commit made while it runs is not the test's
    monkeypatch.setattr(campaign_module, "code_version", lambda: code)
    monkeypatch.setattr(setup_module, "code_version", lambda: code)

    out = tmp_path / "decide"
    args = ["campaign", CONFIG, "--eta", "0,1", "--objective", "decoupled,naive", "--max-steps", "2"]
    args += ["--out", str(out), "--seeds", "2", "--until-clear", "--max-seeds", "3", "--margin", "0.05"]
    args += ["--baseline", "eta0-decoupled", "--eval-limit", "4", "--benches", "heldout"]
    assert main(args) == 0
    decision = json.loads((out / "decision.json").read_text())
    assert decision["baseline"] == "eta0-decoupled" and 2 <= decision["seeds"] <= 3
    runs = sum(len(s["by_seed"]) for s in decision["settings"])
    assert len(decision["settings"]) == 4 and decision["runs_trained"] == runs
    if decision["seeds"] == 2:  # stopped early only where every difference was clear
        assert decision["stopped_because"] == "every difference to the baseline is clear"
    assert len(decision["settings"][0]["by_seed"]) == decision["seeds"]  # the baseline ran every seed
    # a third seed ran of the settings still unclear after two, and of no other
    first = {s["label"]: {int(k): v for k, v in s["by_seed"].items() if int(k) < 2} for s in decision["settings"]}
    clear_at_two = {c.label: c.clear for c in compare(first, "eta0-decoupled", 0.05)}
    for s in decision["settings"][1:]:
        d, n = s["difference"], len(s["by_seed"])
        assert d["n"] == n and d["lo"] <= d["mean"] <= d["hi"]
        assert n == (2 if clear_at_two[s["label"]] else decision["seeds"])
    text = (out / "decision.md").read_text()
    assert "| eta1-naive |" in text and "[" in text and (out / "forest.png").stat().st_size > 5000
    # the artifact after every seed: the decision so far while seeds were to come, then the final one
    shown = sorted((a for a in asyncio.run(_artifacts()) if a.key == "decision-decide"), key=lambda a: a.created)
    heads = [a.data.splitlines()[0] for a in shown]
    so_far = "# Campaign decision so far: held-out accuracy after RL"
    assert heads == [so_far] * (decision["seeds"] - 2) + ["# Campaign decision: held-out accuracy after RL"]
    assert "| eta1-naive |" in shown[-1].data and shown[-1].data == text
    scored = {p: p.stat().st_mtime_ns for p in out.glob("*-s*/evals/v*/summary.json")}
    assert len(scored) == runs  # every run's final checkpoint scored
    capsys.readouterr()
    assert main(args) == 0  # started again: every finished run reused
    again = json.loads((out / "decision.json").read_text())
    assert again["runs_trained"] == 0 and again["runs_reused"] == runs
    assert [s["by_seed"] for s in again["settings"]] == [s["by_seed"] for s in decision["settings"]]
    assert {p: p.stat().st_mtime_ns for p in scored} == scored  # and not scored a second time


@pytest.mark.slow
@pytest.mark.nightly
def test_sweep_command_prints_report_last(prefect_harness, tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "sweep"
    rc = main(
        [
            "sweep",
            CONFIG,
            "--eta",
            "0",
            "--objective",
            "naive",
            "--max-steps",
            "1",
            "--out",
            str(out),
            "--evaluate-every",
            "0",
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == str(out / "report.md") and Path(lines[-1]).exists()
    table = pd.read_csv(out / "report.csv")
    assert list(table["run"]) == ["eta0-naive"]
    assert list(table["objective"]) == ["naive"] and (table["steps"] == 1).all()
    assert (table["eta"] == 0).all() and (table["max_staleness_observed"] == 0).all()


@pytest.mark.slow
@pytest.mark.nightly
def test_sweep_compares_several_configs(prefect_harness, tmp_path, capsys):
    """Several configs: one run per config as it is (its own eta and objective), labelled by its name,
    each from its own frozen copy, one report over them."""
    from flows.cli import main

    cfg = yaml.safe_load(Path(CONFIG).read_text())
    cfg["name"], cfg["trainer"]["objective"] = "tiny_naive", "naive"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "sweep"
    assert main(["sweep", CONFIG, str(other), "--max-steps", "1", "--out", str(out), "--evaluate-every", "0"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out / "report.md")
    table = pd.read_csv(out / "report.csv")
    assert list(table["run"]) == ["tiny", "tiny_naive"] and list(table["objective"]) == ["decoupled", "naive"]
    assert (out / "config-tiny.yaml").exists() and (out / "config-tiny_naive.yaml").exists()
    assert main(["sweep", CONFIG, CONFIG, "--max-steps", "1"]) == 2  # same name twice: labels would clash
    assert "names label the runs" in capsys.readouterr().err


@pytest.mark.slow
def test_train_command_is_a_flow_run(prefect_harness, tmp_path, capsys):
    """`areal-flow train` (what `make demo` runs) runs as a Prefect flow run."""
    from flows.cli import main

    run_dir = tmp_path / "run"
    assert (
        main(["train", CONFIG, "--run-dir", str(run_dir), "--max-steps", "1", "--no-progress", "--evaluate-every", "0"])
        == 0
    )
    assert "ledger: every trajectory trained exactly once" in capsys.readouterr().out
    runs = [r for name, r in asyncio.run(_flow_runs()) if name == "train" and r.parameters["run_dir"] == str(run_dir)]
    assert len(runs) == 1 and runs[0].state.is_completed() and runs[0].parent_task_run_id is None
    assert runs[0].name == "tiny-steps1-s0"  # named from what it runs: config, what differs, seed
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1


def test_bad_sweep_value_fails_before_running(capsys):
    from flows.cli import main

    assert main(["sweep", CONFIG, "--eta", "0", "--objective", "nope"]) == 2
    assert "objective" in capsys.readouterr().err


@pytest.mark.slow
def test_provision_with_s3_credentials_from_a_block(prefect_harness, monkeypatch):
    from prefect.blocks.system import Secret

    from areal_core.storage.fsutil import filesystem
    from flows.provision import provision
    from infra.s3 import MotoS3Server
    from tasks.provision import S3_ENV_KEYS

    for k in S3_ENV_KEYS:  # nothing in the environment: the block must supply it (restored afterwards)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    with MotoS3Server() as s3:
        Secret(value={k: v for k, v in s3.env().items() if k in S3_ENV_KEYS}).save("areal-s3-test", overwrite=True)
        out = provision(
            CONFIG, "unused", overrides={"storage.url": "s3://provisioned/ckpts"}, s3_credentials_block="areal-s3-test"
        )
        assert out["storage"] == {"url": "s3://provisioned/ckpts", "writable": True}
        assert out["rollout"]["backend"] == "embedded" and out["dask"]["workers"] == 1
        fs, _ = filesystem("s3://provisioned")
        assert fs.exists("provisioned") and not fs.ls("provisioned")  # bucket made, probe removed


def test_train_task_retry_resumes(prefect_harness, tmp_path, monkeypatch):
    """A failed training task is retried once, and the retry asks run_experiment to resume."""
    import areal_core.run.setup
    from flows.train import train

    calls = []

    def fake_run_experiment(cfg, run_dir, **kw):
        calls.append(kw["resume"])
        if len(calls) == 1:
            raise RuntimeError("rollout server died")
        kw["on_checkpoint"](1, f"{run_dir}/checkpoints/v1")
        return {
            "name": "tiny",
            "accuracy_before": 0.1,
            "accuracy_after": 0.2,
            "n_eval_problems": 8,
            "steps": 1,
            "eta": 1,
            "objective": "decoupled",
            "max_staleness_observed": 0,
            "effective_train_tokens_per_s": 1.0,
            "rl_time_s": 1.0,
            "wall_time_s": 1.0,
            "ledger_check": {"ok": True},
            "resumed_from_step": 0,
            "final_version": 1,
            "checkpoints": f"{run_dir}/checkpoints",
        }

    monkeypatch.setattr(areal_core.run.setup, "run_experiment", fake_run_experiment)
    out = train(config_path=CONFIG, run_dir=str(tmp_path / "r"), max_steps=1)
    assert calls == [False, True] and out["accuracy_after"] == 0.2


def _summary(run_dir, final_version=3):
    return {
        "name": "tiny",
        "accuracy_before": 0.25,
        "accuracy_after": 0.5,
        "n_eval_problems": 40,
        "steps": 3,
        "eta": 1,
        "objective": "decoupled",
        "max_staleness_observed": 1,
        "effective_train_tokens_per_s": 812.4,
        "rl_time_s": 30.2,
        "wall_time_s": 41.0,
        "ledger_check": {"ok": True},
        "resumed_from_step": None,
        "final_version": final_version,
        "checkpoints": f"{run_dir}/checkpoints",
    }


def test_result_markdown_tables_the_summary_and_links_marked_evaluations(tmp_path, monkeypatch):
    import tasks.evaluation
    from tasks.training import result_markdown

    run_dir = str(tmp_path / "runA")
    (tmp_path / "runA/evals/v2").mkdir(parents=True)
    (tmp_path / "runA/evals/v2/summary.json").write_text(
        json.dumps({"benchmarks": {"heldout": {"pass@1": 0.09000000000000002}}})
    )

    class Found:  # the evaluation of v2 has its artifact; v3's is not scored yet
        latest_id = "1234"

    monkeypatch.setattr(
        tasks.evaluation, "latest_artifacts", lambda keys: {k: Found() for k in keys if k.endswith("v2")}
    )
    md = result_markdown(_summary(run_dir), run_dir, evaluate_every=2)
    assert "held-out accuracy 0.250 -> 0.500" in md and "(+0.250)" in md and "812 tokens/s" in md
    assert "| measure | value |" in md and "every trajectory trained exactly once" in md and "resumed" not in md
    # evaluate_every=2 over 3 versions marks v2 and the final v3 (not v0, v1): one line each
    lines = [line for line in md.splitlines() if line.startswith("- v")]
    assert len(lines) == 2 and lines[0].startswith("- v2: [evaluate-runA-v2](")  # a link to the artifact itself
    assert lines[0].endswith("/artifacts/artifact/1234): heldout pass@1 0.09")  # rounded for people
    assert lines[1] == (
        "- v3: evaluate-runA-v3: not scored yet (the evaluate deployment scores it while `areal-flow stack up` runs)"
    )
    none = result_markdown({**_summary(run_dir), "resumed_from_step": 2}, run_dir, evaluate_every=0)
    assert "none: evaluate_every = 0" in none and "| resumed from step | 2 |" in none
