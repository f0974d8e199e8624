"""`areal-flow runs` lists run folders with their state; `areal-flow report` compares finished runs
(without Prefect here; the flow is the sweep's, tested there) and names a folder that is not one."""

from __future__ import annotations

import json

from flows.cli import main
from tests.unit.test_report import fake_run


def _config(folder, name="quickstart", max_steps=6):
    (folder / "config.json").write_text(json.dumps({"name": name, "trainer": {"max_steps": max_steps}}))


def test_runs_lists_finished_and_unfinished_runs(tmp_path, capsys):
    done = tmp_path / "done"
    fake_run(done, eta=4, objective="decoupled", acc_after=0.62)
    _config(done)
    stopped = tmp_path / "sweep" / "stopped"  # one level deeper, as a sweep's points are
    for v in (0, 2, 4):
        (stopped / "checkpoints" / f"v{v}").mkdir(parents=True)
        (stopped / "checkpoints" / f"v{v}" / "manifest.json").write_text("{}")
    (stopped / "checkpoints" / "v6").mkdir()  # no manifest: being written, not a checkpoint yet
    _config(stopped, name="smollm2", max_steps=40)
    (tmp_path / "not-a-run").mkdir()
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out  # the header and the two runs
    row = {line.split()[0]: line for line in out[1:]}
    assert "finished" in row[str(done)] and "6 / 6" in row[str(done)] and "0.400 -> 0.620" in row[str(done)]
    assert "unfinished, checkpoint v4" in row[str(stopped)] and "4 / 40" in row[str(stopped)]


def test_runs_names_a_missing_folder(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such folder" in capsys.readouterr().err


def test_report_without_prefect_compares_finished_runs(tmp_path, capsys):
    a = fake_run(tmp_path / "a", eta=0, objective="decoupled")
    b = fake_run(tmp_path / "b", eta=4, objective="decoupled", acc_after=0.7)
    assert main(["report", a, b, "--no-prefect", "--out", str(tmp_path / "rep")]) == 0
    assert capsys.readouterr().out.strip().endswith("report.md")
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "0.700" in text and (tmp_path / "rep" / "report.csv").is_file()


def test_report_refuses_a_folder_that_is_not_a_finished_run(tmp_path, capsys):
    a = fake_run(tmp_path / "a", eta=0, objective="decoupled")
    assert main(["report", a, str(tmp_path), "--no-prefect"]) == 2
    assert "not a finished run folder (no summary.json)" in capsys.readouterr().err
