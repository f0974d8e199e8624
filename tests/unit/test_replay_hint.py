"""What a differing exact replay suggests about threads."""

from pathlib import Path

from areal_core.experiment import load_config
from areal_core.run.replay import _threads_hint

CFG = load_config(Path(__file__).resolve().parents[1] / "data/e2e.yaml")


def test_a_replay_on_the_originals_thread_count_suggests_nothing_about_threads():
    assert _threads_hint(CFG, {"trainer_threads": 1}, used=1) == ""


def test_a_replay_on_another_thread_count_names_the_originals():
    hint = _threads_hint(CFG, {"trainer_threads": 1}, used=2)
    assert "ran 1 thread(s)" in hint and "try --threads 1" in hint
