"""``python -m bench trl_peer_smollm2 --sync-server-threads N``: the synchronous run's server on N
threads, said in the record's command and workload; refused with any other benchmark."""

from __future__ import annotations

import json
import sys
import types

import pytest

import bench.__main__ as bench_main


@pytest.mark.parametrize(
    "argv", [["engine", "--sync-server-threads", "1"], ["trl_peer_smollm2", "--sync-server-threads", "0"]]
)
def test_refused_with_another_benchmark_or_no_thread(argv, monkeypatch):
    monkeypatch.setattr(bench_main, "run_one", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        bench_main.main(argv)


def test_the_thread_count_reaches_the_benchmark_and_its_record(monkeypatch, tmp_path):
    got = []
    fake = types.ModuleType("bench.fake")
    fake.run = lambda quick, sync_server_threads=2: got.append(sync_server_threads) or {"summary": {}}
    monkeypatch.setitem(sys.modules, "bench.fake", fake)
    monkeypatch.setattr(bench_main, "results_dir", lambda quick: tmp_path)
    bench_main.run_one("fake", False)
    assert json.loads((tmp_path / "fake.json").read_text())["command"] == "python -m bench fake"
    bench_main.run_one("fake", False, sync_server_threads=1)
    assert got == [2, 1]
    assert json.loads((tmp_path / "fake.json").read_text())["command"] == "python -m bench fake --sync-server-threads 1"
