"""bench/results/summary.json is rebuilt from the records, per CPU kind: a benchmark run on one kind
never replaces another kind's figures, and within a kind the latest record of a benchmark counts."""

import json

from bench.common import record_kind, summarize

AMX = {
    "cpu": "Intel Xeon",
    "vendor": "GenuineIntel",
    "family_model": "6/167",
    "machine": "x86_64",
    "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
    "aten_capability": "AVX512",
    "onednn_max_isa": "default",
    "torch": "2.13.0+cpu",
}
EPYC = {
    **AMX,
    "cpu": "AMD EPYC",
    "vendor": "AuthenticAMD",
    "family_model": "25/17",
    "isa": ["avx2", "avx512f", "avx512_bf16"],
}


def _record(folder, file, kind, finished_at, ratio, benchmark="engine"):
    machine = {"cpu": kind["cpu"], "avx512_bf16": True, "kind": kind}
    r = {
        "benchmark": benchmark,
        "command": f"python -m bench {benchmark}",
        "commit": "abc1234",
        "finished_at": finished_at,
        "wall_s": 1.0,
        "machine": machine,
        "summary": {"ratio": ratio},
    }
    (folder / file).write_text(json.dumps(r))
    return machine


def test_each_kind_keeps_its_own_latest_figures(tmp_path):
    amx = _record(tmp_path, "engine.2026-11-30-amx.json", AMX, "2026-11-30T06:00:00+0000", 2.05)
    epyc = _record(tmp_path, "engine.json", EPYC, "2026-11-29T16:00:00+0000", 1.92)
    _record(tmp_path, "engine.old-epyc.json", EPYC, "2026-11-28T10:00:00+0000", 1.50)
    (tmp_path / "summary.json").write_text(json.dumps({"stale": True}))  # never read, replaced
    (tmp_path / "notes.json").write_text(json.dumps([1, 2]))  # not a record: skipped
    s = summarize(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    kinds = s["by_cpu_kind"]
    assert set(kinds) == {record_kind(amx), record_kind(epyc)} and record_kind(amx) != record_kind(epyc)
    assert kinds[record_kind(amx)]["engine"]["figures"] == {"ratio": 2.05}
    assert kinds[record_kind(epyc)]["engine"]["figures"] == {"ratio": 1.92}  # the later of its two records
    assert kinds[record_kind(epyc)]["engine"]["record"] == "engine.json"


def test_a_record_from_before_kinds_were_recorded_is_named_by_its_cpu():
    assert record_kind({"cpu": "AMD EPYC", "avx512_bf16": False}) == "AMD EPYC (no avx512_bf16; kernels not recorded)"
