"""The one `areal-flow` command module: bad input is an `error:` message with rc 2 (no traceback), and the
Prefect-free paths never import Prefect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "tests/data/e2e.yaml")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", CONFIG, "--set", "trainer.eta"], "--set expects KEY=VALUE"),
        (["train", CONFIG, "--set", "trainer.eta=-1"], "--set trainer.eta=-1: trainer.eta"),  # not the file's line
        (["train", CONFIG, "--set", "rollout.sampling.max_new_tokens='96'"], "valid integer (got '96')"),
        (["train", str(REPO / "no/such.yaml")], "no/such.yaml"),
        (["sweep", CONFIG, "--grid", "seed"], "--grid expects KEY=V1,V2"),
        (["campaign", CONFIG, "--set", "nope"], "--set expects KEY=VALUE"),
        (["eval", "--bench", "nope"], "unknown benchmark"),
        (["eval", "--bench", "gsm8k"], "give a CHECKPOINT_OR_MODEL"),
        (["eval", "some/model", "--bench", "gsm8k", "--reference"], "give no model"),
    ],
)
def test_bad_input_is_an_error_message_with_rc_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err, err


GROUPS = {
    "run": ["train", "sweep", "campaign", "replay"],
    "evaluate": ["eval", "eval-tools", "report"],
    "plan": ["plan", "calibrate", "calibrate-in-situ", "simulate"],
    "operate": ["runs", "export", "serve", "rollout-server", "stack"],
}
COMMANDS = [c for cmds in GROUPS.values() for c in cmds]


def test_every_command_is_in_the_one_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)
    t = build_parser().parse_args(["train", CONFIG, "--no-prefect", "--resume"])
    assert t.no_prefect and t.resume and t.evaluate_every == 50


def test_help_lists_every_command_under_its_group(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    titles = [lines.index(f"{g}:") for g in GROUPS]
    assert titles == sorted(titles), "groups in the order run, evaluate, plan, operate"
    for (group, cmds), start, end in zip(GROUPS.items(), titles, titles[1:] + [len(lines)]):
        listed = [line.split()[0] for line in lines[start + 1 : end] if line.startswith("  ") and line[2] != " "]
        assert [c for c in listed if c in COMMANDS] == cmds, (group, listed)


@pytest.mark.parametrize(
    "argv",
    [[c] for c in COMMANDS] + [["calibrate-in-situ", "measure"], ["calibrate-in-situ", "fit"]],
    ids=" ".join,
)
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: areal-flow {' '.join(argv)} "), out[:200]


def test_building_the_parser_imports_no_simulator_engine_or_torch():
    code = (
        "import sys; from flows.cli import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'prefect', 'areal_core.sim', 'areal_core.rollout.backends.embedded.engine') "
        "if m in sys.modules]; assert not heavy, heavy"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_prefect_free_paths_do_not_import_prefect():
    code = (
        "import sys; from flows.cli import main; "
        "rc = main(['train', 'tests/data/e2e.yaml', '--no-prefect', '--set', 'trainer.eta=-1']); "
        "assert rc == 2, rc; "
        "assert not [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')], 'prefect imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_max_steps_below_one_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", CONFIG, "--max-steps", "-3"])
    assert e.value.code == 2 and "--max-steps: must be at least 1, got -3" in capsys.readouterr().err


def test_a_run_folder_with_checkpoints_needs_resume_and_resume_says_what_it_does(tmp_path, capsys):
    from areal_core.experiment import load_config
    from areal_core.models import build_char_tokenizer
    from areal_core.storage import CheckpointStore
    from flows.train_command import _check_run
    from tests.e2e.test_rollout_server import tiny_qwen2

    cfg = load_config(CONFIG)
    _check_run(cfg, tmp_path / "fresh", resume=True)
    assert "nothing to resume in" in capsys.readouterr().out
    CheckpointStore.from_config(cfg.storage, str(tmp_path / "run")).publish(0, tiny_qwen2(1), build_char_tokenizer())
    capsys.readouterr()  # (transformers' progress bar while saving)
    assert main(["train", CONFIG, "--run-dir", str(tmp_path / "run"), "--no-prefect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "latest v0" in err and "--resume" in err and "--run-dir" in err
    assert main(["train", CONFIG, "--run-dir", str(tmp_path / "run"), "--no-prefect", "--resume"]) == 2
    assert "holds no run state" in capsys.readouterr().err  # a bare checkpoint cannot be resumed


@pytest.mark.slow
def test_resume_with_a_changed_config_is_refused_before_starting(tmp_path, capsys, shared_rewards):
    run = str(tmp_path / "run")
    grading = [x for k, v in shared_rewards.items() for x in ("--set", f"{k}={v}")]  # (not the subject here)
    assert main(["train", CONFIG, "--run-dir", run, "--no-prefect", "--no-progress", "--max-steps", "1", *grading]) == 0
    capsys.readouterr()
    assert main(["train", CONFIG, "--run-dir", run, "--no-prefect", "--resume", "--set", "trainer.eta=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot resume") and "trainer.eta" in err and "Traceback" not in err
    again = ["train", CONFIG, "--run-dir", run, "--no-prefect", "--no-progress", "--resume", "--max-steps", "2"]
    assert main([*again, *grading]) == 0
    out = capsys.readouterr().out
    assert "resuming from checkpoint v1" in out and "resumed from step: 1" in out


def test_eval_names_a_model_argument_it_cannot_load_before_starting(tmp_path, capsys):
    (tmp_path / "ckpts/v3").mkdir(parents=True)
    (tmp_path / "ckpts/v12").mkdir()
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "no/such", "no such file or folder"),
        (tmp_path / "ckpts", f"is a checkpoints folder: give one of its versions, e.g. {tmp_path / 'ckpts/v12'}"),
        (tmp_path / "empty", "neither a checkpoint version nor an HF model folder"),
    ]
    for model, words in cases:
        assert main(["eval", str(model), "--bench", "gsm8k", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.slow
def test_eval_reference_with_out_writes_its_report(tmp_path, capsys, shared_grading):
    import json

    g = shared_grading  # (where it grades is not the subject here)
    grading = ["--scheduler", g.scheduler_address, "--tls-ca-file", g.tls_ca_file, "--tls-cert", g.tls_client_cert]
    grading += ["--tls-key", g.tls_client_key] if g.tls_client_key else []
    argv = ["eval", "--reference", "--bench", "synthetic", "--limit", "5", "--out", str(tmp_path), "--no-progress"]
    assert main([*argv, *grading]) == 0
    report = json.loads((tmp_path / "reference.json").read_text())
    assert (
        report["n"] == 5
        and report["accuracy"] == json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"]
    )


def test_a_bad_records_line_is_reported_before_the_run_starts(tmp_path, capsys):
    import json

    good = {"id": "a", "task": "chain", "prompt": "1+2=", "answer": "3"}
    recs = tmp_path / "records.jsonl"
    recs.write_text("\n".join(json.dumps(r) for r in (good, good, {"id": "b", "task": "chain"})) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        Path(CONFIG).read_text().replace("data:\n", f"data:\n  dataset: {recs}\n  eval_dataset: {recs}\n", 1)
    )
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "run"), "--no-prefect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "line 3" in err and "'prompt'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_missing_dataset_file_is_the_first_error_named(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"  # a missing file is named before anything else is read
    cfg.write_text("model:\n  warm_start: {length_alpha: 3.0}\ndata:\n  dataset: missing.jsonl\n")
    assert main(["train", str(cfg), "--no-prefect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cfg}:4: data.dataset: dataset file 'missing.jsonl' not found"), err


def test_every_argument_has_help_and_version_prints(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = [
        f"{name} {a.dest}" for name, p in sub.choices.items() for a in p._actions if a.dest != "help" and not a.help
    ]
    assert not missing, missing
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("areal-flow ")
