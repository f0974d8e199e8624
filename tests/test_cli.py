"""The one `areal-flow` command module: bad input is an `error:` message with rc 2 (no traceback), and the
Prefect-free paths never import Prefect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "tests/data/e2e.yaml")


@pytest.mark.parametrize("argv, words", [
    (["train", CONFIG, "--set", "trainer.eta"], "--set expects KEY=VALUE"),
    (["train", CONFIG, "--set", "trainer.eta=-1"], "--set trainer.eta=-1: trainer.eta"),  # not the file's line
    (["train", CONFIG, "--set", "rollout.sampling.max_new_tokens='96'"], "valid integer (got '96')"),
    (["train", str(REPO / "no/such.yaml")], "no/such.yaml"),
    (["sweep", CONFIG, "--grid", "seed"], "--grid expects KEY=V1,V2"),
    (["campaign", CONFIG, "--set", "nope"], "--set expects KEY=VALUE"),
    (["eval", "--bench", "nope"], "unknown benchmark"),
    (["eval", "--bench", "gsm8k"], "give a CHECKPOINT_OR_MODEL"),
    (["eval", "some/model", "--bench", "gsm8k", "--reference"], "give no model"),
])
def test_bad_input_is_an_error_message_with_rc_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err, err


def test_every_command_is_in_the_one_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"train", "eval", "sweep", "campaign", "stack"}
    t = build_parser().parse_args(["train", CONFIG, "--no-prefect", "--resume"])
    assert t.no_prefect and t.resume and t.evaluate_every == 50


def test_prefect_free_paths_do_not_import_prefect():
    code = ("import sys; from flows.cli import main; "
            "rc = main(['train', 'tests/data/e2e.yaml', '--no-prefect', '--set', 'trainer.eta=-1']); "
            "assert rc == 2, rc; "
            "assert not [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')], 'prefect imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
