"""CheckpointStore over a real S3 HTTP endpoint (moto_server on 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from botocore.exceptions import BotoCoreError
from fsspec.exceptions import FSTimeoutError

from areal_core.storage import (
    CheckpointStore,
    VersionNotFoundError,
    ensure_bucket,
    fsutil,
    read_json,
    write_json_atomic,
)
from areal_core.storage import checkpoints as ckpt_mod
from infra.s3 import MotoS3Server

REPO = Path(__file__).resolve().parents[2]
S3_ERRORS = (OSError, BotoCoreError, FSTimeoutError)

# a tiny model and tokenizer (also run in a subprocess, hence source text)
HELPERS = textwrap.dedent("""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    def make_tokenizer():
        vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
        vocab.update({f"w{i}": 3 + i for i in range(61)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                       eos_token="<eos>", unk_token="<unk>")

    def make_model(seed):
        torch.manual_seed(seed)
        cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, vocab_size=64)
        return Qwen2ForCausalLM(cfg).eval()
""")
_ns: dict = {}
exec(HELPERS, _ns)
make_model, make_tokenizer = _ns["make_model"], _ns["make_tokenizer"]


def load(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def s3():
    with MotoS3Server() as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env(fast_timeouts=True).items():
            mp.setenv(k, v)
        ensure_bucket("s3://areal-test")
        yield server


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    make_model(3).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return str(d)


def test_publish_and_load_over_s3(s3, tmp_path):
    url = "s3://areal-test/run1/ckpt"
    reader = CheckpointStore(url, cache_dir=str(tmp_path / "cache"))
    assert reader.versions() == [] and reader.latest() is None
    writer = CheckpointStore(url, cache_dir=str(tmp_path / "wcache"))
    tok = make_tokenizer()
    m0 = make_model(0)
    assert writer.publish(0, m0, tok, meta={"step": 0}) == f"{url}/v0"
    assert reader.versions() == [0] and reader.latest() == 0
    # the second version comes from another process; the reader's caches must not hide it
    script = HELPERS + textwrap.dedent(f"""
        from areal_core.storage import CheckpointStore
        CheckpointStore({url!r}).publish(1, make_model(1), make_tokenizer(), meta={{"step": 1}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert reader.versions() == [0, 1] and reader.latest() == 1
    for v, m in ((0, m0), (1, make_model(1))):
        manifest = reader.verify(v)
        assert manifest["meta"] == {"step": v}
        folder = reader.local_copy(v)
        assert folder.startswith(str(tmp_path / "cache"))
        assert_same_weights(load(folder), m)
        assert reader.local_copy(v) == folder  # cached
    assert reader.prune(1) == [0]
    assert reader.versions() == [1]
    with pytest.raises(VersionNotFoundError, match=r"s3://areal-test/run1/ckpt/v0/manifest.json"):
        reader.read_manifest(0)


def test_atomic_json_over_s3(s3):
    write_json_atomic("s3://areal-test/state/x.json", {"a": 1})
    assert read_json("s3://areal-test/state/x.json") == {"a": 1}
    write_json_atomic("s3://areal-test/state/x.json", {"a": 2})
    assert read_json("s3://areal-test/state/x.json") == {"a": 2}


def _pause_after_first_put(monkeypatch, server: MotoS3Server, resume_after_s: float | None):
    real = ckpt_mod.put_file_atomic
    state = {"puts": 0}

    def put(fs, src, dest):
        state["puts"] += 1
        if state["puts"] == 2:  # the endpoint stalls before the second file
            server.pause()
            if resume_after_s is not None:
                threading.Timer(resume_after_s, server.resume).start()
        real(fs, src, dest)

    monkeypatch.setattr(ckpt_mod, "put_file_atomic", put)
    return state


def test_publish_survives_short_outage(s3, saved, monkeypatch):
    store = CheckpointStore("s3://areal-test/outage-short", retries=8, backoff_s=0.2)
    state = _pause_after_first_put(monkeypatch, s3, resume_after_s=3.0)
    t0 = time.monotonic()
    store.publish_folder(0, saved)
    assert time.monotonic() - t0 >= 3.0
    assert state["puts"] > len(os.listdir(saved))  # some uploads were retried
    assert store.versions() == [0]
    store.verify(0)


def test_publish_fails_when_outage_outlasts_retries(s3, saved, monkeypatch):
    store = CheckpointStore("s3://areal-test/outage-long", retries=2, backoff_s=0.1)
    store.publish_folder(0, saved)
    _pause_after_first_put(monkeypatch, s3, resume_after_s=None)
    try:
        t0 = time.monotonic()
        with pytest.raises(S3_ERRORS) as info:
            store.publish_folder(1, saved)
        assert fsutil.is_transient(info.value)
        assert time.monotonic() - t0 < 20  # timed out, did not hang
    finally:
        s3.resume()
    time.sleep(0.5)  # requests the stalled server had accepted may land now
    assert store.versions() == [0] and store.latest() == 0
    with pytest.raises(VersionNotFoundError):
        store.read_manifest(1)
    monkeypatch.undo()
    store.publish_folder(1, saved)  # the partial leftover is cleaned and rewritten
    assert store.versions() == [0, 1]
    store.verify(1)


def test_server_stop_is_final_and_idempotent():
    server = MotoS3Server().start()
    pid = server.pid
    assert alive(pid)
    server.pause()  # stopping a paused server must still work
    server.stop()
    assert not alive(pid) and server.pid is None and not server.running()
    server.stop()
    with pytest.raises(S3_ERRORS):  # connection refused: fails fast, no hang
        fs, _ = fsutil.filesystem("s3://nothing", env=server.env(fast_timeouts=True))
        fs.invalidate_cache()
        fs.ls("nothing")


def test_cli_prints_env_and_stops_its_server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.s3", "--bucket", "cli-bucket"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("# moto_server pid"):
                break
        env = dict(ln[len("export ") :].split("=", 1) for ln in lines if ln.startswith("export "))
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        moto_pid = int(lines[-1].split()[3].rstrip(";"))
        assert alive(moto_pid)
        fs, _ = fsutil.filesystem("s3://cli-bucket", env=env)
        fs.invalidate_cache()
        assert fs.exists("cli-bucket")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert not alive(moto_pid)


def test_records_round_trip_over_s3(s3):
    """Records files on S3 go through the project's S3 settings (the moto endpoint from the
    environment), for reading as well as writing."""
    from areal_core.data.records import Record, RecordError, read_records, write_records

    recs = [Record(id=f"c{i}", task="chain", prompt="a3b5=", answer="8", meta={"k": 2}) for i in range(3)]
    for ext in ("jsonl", "parquet"):
        url = f"s3://areal-test/data/recs.{ext}"
        write_records(recs, url)
        assert read_records(url) == recs
    with pytest.raises(RecordError, match="no such records file"):
        read_records("s3://areal-test/data/missing.jsonl")
