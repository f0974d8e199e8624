"""The docs' rendered tables are what their records give (bench/render.py)."""

from __future__ import annotations

import json
import shutil

from bench.common import REPO_ROOT
from bench.render import BLOCK, DOCS, RENDERERS, render_block, rendered, renderer_name, source_line, stale_blocks


def _records() -> set[str]:
    return {m.group("record") for f in DOCS for m in BLOCK.finditer((REPO_ROOT / f).read_text())}


def test_every_rendered_block_in_the_docs_is_what_its_record_gives():
    assert stale_blocks() == [], "run `python -m bench.render`"
    assert sum(len(BLOCK.findall((REPO_ROOT / f).read_text())) for f in DOCS) >= 30


def test_every_block_has_a_renderer_and_every_renderer_a_block():
    records = _records()
    assert {renderer_name(r) for r in records} == set(RENDERERS)
    for record in records:
        body = render_block(record)
        assert body.startswith("| ") and ("\nRecord: " in body or "\nRecords: " in body), record


def test_a_record_outside_bench_results_a_part_of_a_record_and_a_folder_of_records():
    # a file anywhere in the repository, one of its tables (#part), a folder of run records
    records = _records()
    assert "areal_core/sim/data/calibration_quickstart.json#in_situ" in records
    assert "bench/results/objective_ablation_smollm2_runs/" in records
    assert (
        renderer_name("areal_core/sim/data/calibration_quickstart.json#in_situ")
        == "calibration_quickstart.json#in_situ"
    )
    assert renderer_name("bench/results/objective_ablation_smollm2_runs/") == "objective_ablation_smollm2_runs"
    assert (
        BLOCK.search("<!-- rendered from ../secret.json (python -m bench.render) -->\nx\n<!-- end rendered -->") is None
    )
    calibration = render_block("areal_core/sim/data/calibration_quickstart.json")
    assert "Record: `python -m areal_core.sim.measure`" in calibration and "load 0.53 at the start" in calibration


def test_a_table_from_runs_of_several_commits_has_a_commit_column():
    runs = render_block("bench/results/objective_ablation_smollm2_runs/")
    head = runs.splitlines()[0]
    assert "| commit |" in head and "| 74efdb8 |" in runs and "| 6393b03 |" in runs
    assert "Records: `python -m bench objective_ablation --model smollm2`" in runs


def test_a_command_in_words_is_not_put_in_a_code_span():
    line = source_line({"command": "runs of `python -m bench x`, then y", "machine": {"cpu": "AMD EPYC"}})
    assert line.startswith("Record: runs of `python -m bench x`, then y; ") and line.endswith(
        "date not recorded in the file."
    )


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


def test_a_campaigns_off_policy_table_pools_its_seeds_steps_as_counted_by_hand(tmp_path):
    import pandas as pd

    from bench.render import campaign_off_policy

    def run(name, tokens, masked, behav, applied, ess, gap, gap_tokens):
        (tmp_path / name).mkdir()
        pd.DataFrame(
            {
                "tokens_trained": tokens,
                "offpolicy_masked_fraction": masked,
                "offpolicy_truncated_fraction": [0.0] * len(tokens),
                "behav_weight_max": behav,
                "offpolicy_weight_max": applied,
                "offpolicy_ess": ess,
                "logprob_gap_sum": gap,
                "logprob_gap_tokens_sum": gap_tokens,
            }
        ).to_parquet(tmp_path / name / "metrics.parquet")

    run("icepop-s0", [100, 300], [0.1, 0.0], [3.0, 7.0], [3.0, 5.0], [0.9, 1.0], [0.02, 0.0], [10, 0])
    run("icepop-s1", [100, 100], [0.2, 0.0], [2.0, 4.0], [2.0, 4.0], [0.8, 1.0], [0.01, 0.03], [10, 20])
    run("naive-s0", [100], [0.0], [1.0], [1.0], [1.0], [0.0], [1])
    rows = [
        {"setting": "icepop", "run_dir": "x/icepop-s0", "objective": "decoupled", "max_staleness": 8},
        {"setting": "icepop", "run_dir": "x/icepop-s1", "objective": "decoupled", "max_staleness": 6},
        {"setting": "naive", "run_dir": "x/naive-s0", "objective": "naive", "max_staleness": 7},
    ]
    table = campaign_off_policy(
        {"decision": {"settings": [{"label": "icepop"}, {"label": "naive"}]}, "rows": rows}, tmp_path
    )
    lines = table.splitlines()
    # masked: (0.1*100 + 0.2*100) / 600 tokens = 5 %; ESS (0.9+1+0.8+1)/4; gap 0.06 nats over 40 tokens
    assert lines[2] == "| `icepop` | 8 | 7.00 | 5.00 | masked 5.0 % | 0.925 | 1.5e-03 |"
    assert lines[3] == "| `naive` | 7 | - | - | - | - | 0.0e+00 |"  # naive PPO has no behaviour weight
