"""The docs' rendered tables are what their records give (bench/render.py)."""

from __future__ import annotations

import json
import shutil

from bench.common import REPO_ROOT
from bench.render import BLOCK, DOCS, RENDERERS, render_block, rendered, source_line, stale_blocks


def test_every_rendered_block_in_the_docs_is_what_its_record_gives():
    assert stale_blocks() == [], "run `python -m bench.render`"
    assert sum(len(BLOCK.findall((REPO_ROOT / f).read_text())) for f in DOCS) >= 18


def test_every_renderer_renders_its_record_and_every_block_has_one():
    for name in RENDERERS:
        body = render_block(f"bench/results/{name}")
        assert body.startswith("| ") and "\nRecord: `python -m bench " in body, name
    records = {m.group("record") for f in DOCS for m in BLOCK.finditer((REPO_ROOT / f).read_text())}
    assert {r.rsplit("/", 1)[1] for r in records} <= set(RENDERERS)


def test_a_record_without_a_cpu_kind_still_says_whether_its_cpu_has_bf16_units():
    line = source_line({"command": "c", "machine": {"cpu": "AMD EPYC", "avx512_bf16": False, "torch": "2.13.0+cpu"}})
    assert "AMD EPYC (no avx512_bf16; torch 2.13.0+cpu)" in line and "commit not recorded in the file" in line
    assert "CPU not recorded" in source_line({"command": "c"})


def test_a_table_from_rows_of_two_machines_has_a_cpu_column():
    # repeatability.json's seeds rows are quickstart_seeds.json's runs, whose machine it does not hold
    body = render_block("bench/results/repeatability.json")
    assert body.splitlines()[0].endswith("| CPU |") and "not in this record" in body


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
