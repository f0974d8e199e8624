"""A campaign's loop (areal_core/run/campaign.py): paired seeds, seeds added until clear or the budget is
spent, finished runs reused (never trained again) where config and code match, and its report."""

import json
import shutil
from pathlib import Path

import pytest

from areal_core.report.decision import write_decision_report
from areal_core.run.campaign import CampaignFolderError, CampaignPlan, run_campaign, run_dir_of
from areal_core.run.decide import Budget
from areal_core.run.folder import code_version

# each setting's true effect on top of a seed's own level: eta4 is clearly better, naive the same
EFFECT = {"eta0": 0.0, "eta4": 0.05, "naive": 0.0}


def _config_of(ov: dict) -> dict:
    return {"seed": ov["seed"], "overrides": {k: v for k, v in ov.items() if k != "seed"}}


class FakeTrainer:
    """Writes what a finished run leaves (config.json, summary.json, metrics.parquet-free) with an outcome
    from the seed and the setting; counts what it trained."""

    def __init__(self, noise: float = 0.004, config_of=_config_of):
        self.trained: list[tuple[str, int]] = []
        self.resumed: list[tuple[str, int]] = []
        self.noise = noise
        self.config_of = config_of

    def __call__(self, label: str, seed: int, ov: dict, run_dir: Path, resume: bool) -> None:
        self.trained.append((label, seed))
        if resume:
            self.resumed.append((label, seed))
        run_dir.mkdir(parents=True, exist_ok=True)
        level = 0.3 + 0.1 * ((seed * 7) % 5)  # the seeds differ much more than the settings
        jitter = self.noise * (1 if (seed + len(label)) % 2 else -1)
        after = level + EFFECT[label] + jitter
        (run_dir / "config.json").write_text(json.dumps(self.config_of(ov)))
        (run_dir / "summary.json").write_text(
            json.dumps({"accuracy_before": level - 0.1, "accuracy_after": after, "code": code_version()})
        )


def _plan(**kw) -> CampaignPlan:
    points = [(label, {"x": label}) for label in EFFECT]
    return CampaignPlan(points, "eta0", **kw)


def test_a_campaign_adds_seeds_of_the_unclear_settings_and_the_baseline_until_every_difference_is_clear(tmp_path):
    # eta4's paired differences are 0.05 on every seed: clear ("better") after the first 2 seeds; naive's
    # are +-0.008 by turns: unclear at 2 and 3 seeds, within +-0.02 at 4
    trainer, said, shown = FakeTrainer(), [], []

    def show(decision):  # what the flow draws after every seed: the decision on disk is the one handed over
        assert json.loads((tmp_path / "decision.json").read_text()) == decision
        lines = write_decision_report(tmp_path).splitlines()
        state = next(line for line in lines if line.startswith(("Running", "Stopped")))
        shown.append((decision["final"], decision["seeds"], lines[0], state.split(". Runs")[0]))

    plan = _plan(seeds=2, until_clear=True, margin=0.02)
    d = run_campaign(plan, tmp_path, _config_of, trainer, say=said.append, on_decision=show)
    verdicts = {s["label"]: s["verdict"] for s in d["settings"]}
    assert verdicts == {"eta0": "baseline", "eta4": "better", "naive": "same within the margin"}
    assert d["seeds"] == 4 and d["stopped_because"] == "every difference to the baseline is clear"
    first = [(label, s) for s in (0, 1) for label in EFFECT]
    assert trainer.trained == first + [("eta0", 2), ("naive", 2), ("eta0", 3), ("naive", 3)]
    assert d["runs_trained"] == 10 and d["runs_reused"] == 0
    assert {s["label"]: s["outcome"]["n"] for s in d["settings"]} == {"eta0": 4, "eta4": 2, "naive": 4}
    assert [s["difference"]["n"] for s in d["settings"][1:]] == [2, 4]  # over the seeds both ran
    assert "still unclear: naive; seed 2 next, of them and the baseline eta0" in said
    # the decision so far after 2 and 3 seeds, the final one after 4
    so_far, final = (
        "# Campaign decision so far: held-out accuracy after RL",
        "# Campaign decision: held-out accuracy after RL",
    )
    assert shown == [
        (False, 2, so_far, "Running: still unclear: naive; seed 2 next, of them and the baseline eta0"),
        (False, 3, so_far, "Running: still unclear: naive; seed 3 next, of them and the baseline eta0"),
        (True, 4, final, "Stopped: every difference to the baseline is clear"),
    ]
    assert not run_dir_of(tmp_path, "eta4", 2).exists()
    report = write_decision_report(tmp_path)
    assert "2-4 seeds per setting" in report and "Stopped: every difference to the baseline is clear." in report
    on_disk = json.loads((tmp_path / "decision.json").read_text())
    assert on_disk == d
    # started again over the folder: the same seeds of the same settings, every run reused
    again = FakeTrainer()
    d2 = run_campaign(plan, tmp_path, _config_of, again, say=lambda s: None)
    assert again.trained == [] and d2["runs_reused"] == 10 and d2["settings"] == d["settings"]


def test_a_campaign_resumes_without_training_a_finished_run_again(tmp_path):
    first = FakeTrainer()
    run_campaign(_plan(seeds=2), tmp_path, _config_of, first, say=lambda s: None)
    assert len(first.trained) == 6
    # started again over the same folder: every finished run reused
    again = FakeTrainer()
    d = run_campaign(_plan(seeds=2), tmp_path, _config_of, again, say=lambda s: None)
    assert again.trained == [] and d["runs_reused"] == 6 and d["runs_trained"] == 0
    # one more seed: only the new seed's runs are trained
    more = FakeTrainer()
    run_campaign(_plan(seeds=3), tmp_path, _config_of, more, say=lambda s: None)
    assert sorted(more.trained) == [("eta0", 2), ("eta4", 2), ("naive", 2)]
    # a folder holding a run of another config or other code is never trained over: the campaign says so
    changed = FakeTrainer()
    plan = CampaignPlan([("eta0", {"x": "eta0"}), ("eta4", {"x": "other"}), ("naive", {"x": "naive"})], "eta0", seeds=3)
    with pytest.raises(CampaignFolderError, match=r"eta4-s0 holds a run .*its config differs"):
        run_campaign(plan, tmp_path, _config_of, changed, say=lambda s: None)
    assert changed.trained == []
    summary = run_dir_of(tmp_path, "naive", 1) / "summary.json"
    s = json.loads(summary.read_text())
    summary.write_text(json.dumps({**s, "code": {**s["code"], "commit": "another"}}))
    with pytest.raises(CampaignFolderError, match=r"naive-s1 holds a run .*it ran other code"):
        run_campaign(_plan(seeds=3), tmp_path, _config_of, changed, say=lambda s: None)
    # once removed, it is trained again (and only it)
    shutil.rmtree(run_dir_of(tmp_path, "naive", 1))
    run_campaign(_plan(seeds=3), tmp_path, _config_of, changed, say=lambda s: None)
    assert changed.trained == [("naive", 1)]


def _stopped_run(run_dir: Path, config: dict, version: int | None, code: dict | None) -> None:
    """What a run stopped after checkpoint ``version`` leaves: config.json and that checkpoint's run state
    naming ``code`` (None: a state that names none); no checkpoint where ``version`` is None."""
    from areal_core.storage import CheckpointStore
    from areal_core.storage.run_state import FORMAT, STATE

    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config))
    if version is None:
        return
    state = {"format": FORMAT, "step": version, "config": config, "controller": {}, "before": None}
    folder = run_dir.parent / f"{run_dir.name}-state"
    (folder / STATE).parent.mkdir(parents=True)
    (folder / STATE).write_text(json.dumps(state if code is None else {**state, "code": code}))
    CheckpointStore(str(run_dir / "checkpoints")).publish_folder(version, str(folder))


def test_a_stopped_run_is_continued_from_its_checkpoint_only_at_the_same_code(tmp_path):
    code = code_version()
    said = []
    _stopped_run(run_dir_of(tmp_path, "eta4", 0), _config_of({"x": "eta4", "seed": 0}), 3, code)
    _stopped_run(run_dir_of(tmp_path, "naive", 0), _config_of({"x": "naive", "seed": 0}), None, None)
    trainer = FakeTrainer()
    d = run_campaign(_plan(seeds=1), tmp_path, _config_of, trainer, say=said.append)
    # the run with a checkpoint continues from it; the one stopped before any starts afresh
    assert trainer.resumed == [("eta4", 0)] and sorted(trainer.trained) == [("eta0", 0), ("eta4", 0), ("naive", 0)]
    assert any("eta4 seed 0: continued from its checkpoint v3" in line for line in said)
    assert d["runs_trained"] == 3
    # a run stopped by other code, or whose checkpoint does not name its code, is never continued
    for label, other, why in (
        ("eta4", {**code, "commit": "another"}, r"written by other code \(\{'commit': 'another'"),
        ("naive", None, "which does not name its code"),
    ):
        _stopped_run(run_dir_of(tmp_path, label, 1), _config_of({"x": label, "seed": 1}), 5, other)
        refused = FakeTrainer()
        with pytest.raises(CampaignFolderError, match=rf"{label}-s1 holds a run .*stopped at v5, {why}"):
            run_campaign(_plan(seeds=2), tmp_path, _config_of, refused, say=lambda s: None)
        assert (label, 1) not in refused.trained and refused.resumed == []
        shutil.rmtree(run_dir_of(tmp_path, label, 1))


def test_a_campaign_reuses_and_continues_its_runs_where_only_their_reward_cluster_moved(tmp_path):
    """A campaign started again against a reward cluster at another address, with other certificate
    files (a standing cluster restarted, a pool provisioned afresh): its finished runs are reused and a
    stopped one continues; a setting that changes what a run computes still refuses the folder."""

    def config_at(**reward):
        return lambda ov: {**_config_of(ov), "reward": {"timeout_s": 30.0, **reward}}

    a = config_at(scheduler_address="tls://10.0.0.1:8786", tls_ca_file="/etc/a/ca.pem", n_workers=4)
    b = config_at(scheduler_address="tls://10.0.0.2:9000", tls_ca_file="/etc/b/ca.pem", n_workers=2)
    run_campaign(_plan(seeds=1), tmp_path, a, FakeTrainer(config_of=a), say=lambda s: None)
    _stopped_run(run_dir_of(tmp_path, "eta4", 1), a({"x": "eta4", "seed": 1}), 3, code_version())
    moved = FakeTrainer(config_of=b)
    d = run_campaign(_plan(seeds=2), tmp_path, b, moved, say=lambda s: None)
    assert d["runs_reused"] == 3 and moved.resumed == [("eta4", 1)]
    assert sorted(moved.trained) == [("eta0", 1), ("eta4", 1), ("naive", 1)]
    other = config_at(scheduler_address="tls://10.0.0.2:9000", timeout_s=5.0)
    with pytest.raises(
        CampaignFolderError, match=r"eta0-s0 holds a run .*differs from the campaign's in reward\.timeout_s;"
    ):
        run_campaign(_plan(seeds=2), tmp_path, other, FakeTrainer(config_of=other), say=lambda s: None)


def test_the_budget_stops_a_campaign_and_says_what_is_still_unclear(tmp_path):
    noisy = FakeTrainer(noise=0.05)  # the noise swamps eta4's effect at a few seeds
    d = run_campaign(
        _plan(seeds=2, until_clear=True, budget=Budget(max_runs=9)), tmp_path, _config_of, noisy, say=lambda s: None
    )
    # eta4's differences are exactly its effect (clear at 2 seeds), naive's +-0.1 by turns: seed 2 costs
    # 2 runs (8 in all), seed 3 would pass 9
    assert d["seeds"] == 3 and len(noisy.trained) == 8 and ("eta4", 2) not in noisy.trained
    assert (
        d["stopped_because"] == "budget spent (8 runs; another seed's 2 would pass --max-runs 9); still unclear: naive"
    )


def test_the_decision_report_has_the_table_and_both_plots(tmp_path):
    run_campaign(_plan(seeds=3), tmp_path, _config_of, FakeTrainer(), say=lambda s: None)
    text = write_decision_report(tmp_path)
    assert "| eta4 | 3 |" in text and "better" in text and "baseline" in text
    assert (tmp_path / "forest.png").stat().st_size > 5000 and (tmp_path / "decision.md").read_text() == text
    assert (tmp_path / "curves.png").is_file()  # (no metrics in these fake runs: an empty plot)


def test_a_plan_is_checked():
    with pytest.raises(ValueError, match="baseline 'eta9'"):
        CampaignPlan([("eta0", {})], "eta9")
    with pytest.raises(ValueError, match="outcome must be one of"):
        CampaignPlan([("eta0", {})], "eta0", outcome="loss")


def test_named_settings_keep_their_order_and_labels_and_bad_ones_are_refused():
    from areal_core.run.sweep import named_points

    settings = {
        "float32": {"model.dtype": "float32"},
        "bf16-servers": {"model.dtype": "float32", "rollout.dtype": "bfloat16"},
    }
    assert named_points(settings) == [
        ("float32", {"model.dtype": "float32"}),
        ("bf16-servers", {"model.dtype": "float32", "rollout.dtype": "bfloat16"}),
    ]
    with pytest.raises(ValueError, match=r"setting label 'a b'.*names the runs' folders"):
        named_points({"a b": {"seed": 1}})
    with pytest.raises(ValueError, match=r"setting 'x': expected a mapping of dotted config keys"):
        named_points({"x": {}})
    with pytest.raises(ValueError, match=r"at least one named setting"):
        named_points({})


def test_setting_flags_are_read_as_yaml_mappings_and_misuse_names_the_flag():
    from flows.cli_input import UsageError, settings_from

    got = settings_from(["f32={model.dtype: float32}", "mix={model.dtype: float32, rollout.dtype: bfloat16}"])
    assert got == {"f32": {"model.dtype": "float32"}, "mix": {"model.dtype": "float32", "rollout.dtype": "bfloat16"}}
    for bad in ("f32", "f32=float32", "={a: 1}", "x={a: [1,}"):
        with pytest.raises(UsageError, match=r"--setting expects LABEL=\{KEY: VALUE, \.\.\.\}"):
            settings_from([bad])
    with pytest.raises(UsageError, match=r"--setting f32 given twice"):
        settings_from(["f32={a: 1}", "f32={a: 2}"])


def test_the_campaign_command_checks_every_named_setting_before_it_runs(capsys):
    from flows.cli import main

    e2e = str(Path(__file__).resolve().parents[1] / "data/e2e.yaml")
    assert main(["campaign", e2e, "--setting", "ok={trainer.eta: 0}", "--setting", "bad={trainer.eta: -1}"]) == 2
    err = capsys.readouterr().err
    assert "--setting bad:" in err and "trainer.eta" in err
    assert main(["campaign", e2e, "--eta", "0,4", "--setting", "ok={trainer.eta: 0}"]) == 2
    assert "without --eta, --objective or --grid" in capsys.readouterr().err


def test_the_summary_reports_format_apart_from_accuracy():
    from areal_core.run.summary import summary_rows

    base = {
        "n_eval_problems": 400,
        "accuracy_before": 0.2,
        "accuracy_after": 0.45,
        "steps": 40,
        "eta": 4,
        "objective": "decoupled",
        "max_staleness_observed": 4,
        "effective_train_tokens_per_s": 100.0,
        "rl_time_s": 10.0,
        "wall_time_s": 20.0,
        "ledger_check": {"ok": True},
    }
    rows = dict(summary_rows({**base, "answered_before": 0.5, "answered_after": 0.9}))
    assert (
        rows["held-out answers in a form graded"]
        == "before RL 0.500 -> after RL 0.900; right among them 0.400 -> 0.500"
    )
    assert "held-out answers in a form graded" not in dict(summary_rows(base))  # (older summaries)
    none = dict(summary_rows({**base, "accuracy_before": 0.0, "answered_before": 0.0, "answered_after": 0.9}))
    assert none["held-out answers in a form graded"].startswith(
        "before RL 0.000 -> after RL 0.900; right among them - ->"
    )
