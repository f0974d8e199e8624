"""The docs' rendered tables are what their records give (bench/render.py)."""

from __future__ import annotations

import json
import shutil

from bench.common import REPO_ROOT
from bench.render import BLOCK, DOCS, rendered, stale_blocks


def test_every_rendered_block_in_the_docs_is_what_its_record_gives():
    assert stale_blocks() == [], "run `python -m bench.render`"
    assert sum(len(BLOCK.findall((REPO_ROOT / f).read_text())) for f in DOCS) >= 3


def test_a_changed_record_makes_its_block_stale_until_rendered_again(tmp_path):
    record = "bench/results/preemption_slurm.json"
    (tmp_path / "bench/results").mkdir(parents=True)
    shutil.copy(REPO_ROOT / record, tmp_path / record)
    doc = tmp_path / "doc.md"
    doc.write_text(
        f"before\n<!-- rendered from {record} (python -m bench.render) -->\nold\n<!-- end rendered -->\nafter\n"
    )
    assert stale_blocks(["doc.md"], tmp_path) == [f"doc.md: the block from {record}"]
    doc.write_text(rendered(doc.read_text(), tmp_path))
    assert stale_blocks(["doc.md"], tmp_path) == [] and doc.read_text().startswith("before\n")
    data = json.loads((tmp_path / record).read_text())
    first = data["rows"][0]
    # the row as the record gives it, read straight from the JSON
    assert (
        f"| {first['tokens_per_s']:,.0f} |" in doc.read_text()
        and "Record: `python -m bench preemption_slurm`" in doc.read_text()
    )
    first["tokens_per_s"] += 1000
    (tmp_path / record).write_text(json.dumps(data))
    assert stale_blocks(["doc.md"], tmp_path) == [f"doc.md: the block from {record}"]


def test_a_record_names_the_commit_it_was_measured_at(tmp_path):
    import subprocess

    from bench.common import save

    path = save("example", True, {"summary": {}}, 1.0, tmp_path)
    record = json.loads(path.read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert (
        record["commit"].split("+")[0] == head.stdout.strip() and record["command"] == "python -m bench example --quick"
    )
