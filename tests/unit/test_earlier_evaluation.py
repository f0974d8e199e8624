"""A checkpoint's evaluation found again: only one that scored every bench asked for, with the same
settings, and ran to its end."""

import json

from areal_core.eval.harness import earlier_evaluation

# as evaluate_checkpoint records them for limit=4 and its other defaults
SETTINGS = {"samples": 1, "limit": 4, "temperature": None, "top_p": None, "max_new_tokens": None}


def _write(folder, **summary):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))


def test_a_finished_evaluation_of_the_same_benches_and_settings_is_found(tmp_path):
    _write(tmp_path, settings=SETTINGS, benchmarks={"heldout": {"pass@1": 0.5}, "gsm8k": {}}, wall_s=3.0)
    found = earlier_evaluation(str(tmp_path), ["heldout"], limit=4)
    assert found is not None and found["benchmarks"]["heldout"]["pass@1"] == 0.5


def test_none_where_nothing_was_scored(tmp_path):
    assert earlier_evaluation(str(tmp_path / "v3"), ["heldout"], limit=4) is None


def test_none_where_a_bench_is_missing_the_settings_differ_or_it_stopped_part_way(tmp_path):
    _write(tmp_path / "a", settings=SETTINGS, benchmarks={"heldout": {}}, wall_s=3.0)
    assert earlier_evaluation(str(tmp_path / "a"), ["heldout", "gsm8k"], limit=4) is None
    _write(tmp_path / "b", settings={**SETTINGS, "limit": None}, benchmarks={"heldout": {}}, wall_s=3.0)
    assert earlier_evaluation(str(tmp_path / "b"), ["heldout"], limit=4) is None
    _write(tmp_path / "c", settings=SETTINGS, benchmarks={"heldout": {}})  # no wall_s: stopped before its end
    assert earlier_evaluation(str(tmp_path / "c"), ["heldout"], limit=4) is None
