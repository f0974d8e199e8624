"""CheckpointStore on a local folder, and the atomic file helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from areal_core.storage import (
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    VersionExistsError,
    VersionNotFoundError,
    fsutil,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from areal_core.storage import checkpoints as ckpt_mod

REPO = Path(__file__).resolve().parents[2]
CODE = {"commit": "c0ffee", "changes": None, "version": "0"}  # the code a run state names


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"w{i}": 3 + i for i in range(61)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    return Qwen2ForCausalLM(cfg).eval()


def load(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A saved model folder, for the fast publish_folder path."""
    d = tmp_path_factory.mktemp("saved")
    make_model(7).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def test_publish_and_load_two_versions(tmp_path, tokenizer):
    from transformers import PreTrainedTokenizerFast

    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.versions() == [] and store.latest() is None
    models = {0: make_model(0), 1: make_model(1)}
    for v, m in models.items():
        url = store.publish(v, m, tokenizer, meta={"step": 10 * v})
        assert url == store.version_url(v) == str(tmp_path / "ckpt" / f"v{v}")
    assert store.versions() == [0, 1] and store.latest() == 1
    for v, m in models.items():
        folder = store.local_copy(v)
        assert folder == store.version_url(v)
        assert_same_weights(load(folder), m)
        manifest = store.verify(v)
        assert manifest["version"] == v and manifest["meta"] == {"step": 10 * v}
        names = {f["path"] for f in manifest["files"]}
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
        tok = PreTrainedTokenizerFast.from_pretrained(folder)
        assert tok("w1 w2")["input_ids"] == tokenizer("w1 w2")["input_ids"]
    # a file:// URL names the same store
    assert CheckpointStore(f"file://{tmp_path / 'ckpt'}").versions() == [0, 1]


def test_crash_mid_publish_leaves_previous_version(tmp_path, saved, tokenizer):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    m0 = make_model(0)
    store.publish(0, m0, tokenizer)
    # A publisher that dies (os._exit, no cleanup) right after its first file.
    script = textwrap.dedent(f"""
        import os
        from areal_core.storage import CheckpointStore, checkpoints
        real = checkpoints.put_file_atomic
        def put_then_die(fs, src, dest):
            real(fs, src, dest)
            os._exit(9)
        checkpoints.put_file_atomic = put_then_die
        CheckpointStore({str(tmp_path / "ckpt")!r}).publish_folder(1, {saved!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    partial = tmp_path / "ckpt" / "v1"
    assert partial.is_dir() and len(os.listdir(partial)) == 1
    assert not (partial / "manifest.json").exists()
    assert store.versions() == [0] and store.latest() == 0
    with pytest.raises(VersionNotFoundError, match="v1"):
        store.read_manifest(1)
    assert_same_weights(load(store.local_copy(0)), m0)
    # the version can be published after the crash
    m1 = make_model(1)
    store.publish(1, m1, tokenizer)
    assert store.versions() == [0, 1]
    store.verify(1)
    assert_same_weights(load(store.local_copy(1)), m1)


def test_failing_upload_retries_then_gives_up(tmp_path, saved, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"), retries=2, backoff_s=0.01)
    store.publish_folder(0, saved)
    calls = []

    def always_fails(fs, src, dest):
        calls.append(dest)
        raise ConnectionError("endpoint unavailable")

    monkeypatch.setattr(ckpt_mod, "put_file_atomic", always_fails)
    with pytest.raises(ConnectionError):
        store.publish_folder(1, saved)
    assert len(calls) == 3 and len(set(calls)) == 1  # 1 try + 2 retries of the first file
    assert not (tmp_path / "ckpt" / "v1" / "manifest.json").exists()
    assert store.versions() == [0] and store.latest() == 0


def test_transient_failures_are_retried(tmp_path, saved, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"), retries=3, backoff_s=0.01)
    real = ckpt_mod.put_file_atomic
    failures = {"left": 2}

    def flaky(fs, src, dest):
        if failures["left"]:
            failures["left"] -= 1
            raise TimeoutError("slow endpoint")
        real(fs, src, dest)

    monkeypatch.setattr(ckpt_mod, "put_file_atomic", flaky)
    store.publish_folder(0, saved)
    assert store.versions() == [0]
    store.verify(0)


def test_non_transient_error_is_not_retried(tmp_path, saved, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"), retries=5, backoff_s=0.01)
    calls = []

    def denied(fs, src, dest):
        calls.append(dest)
        raise PermissionError("access denied")

    monkeypatch.setattr(ckpt_mod, "put_file_atomic", denied)
    with pytest.raises(PermissionError):
        store.publish_folder(0, saved)
    assert len(calls) == 1 and store.versions() == []


def test_refuses_to_overwrite_complete_version(tmp_path, saved):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.publish_folder(0, saved, meta={"a": 1})
    before = store.read_manifest(0)
    with pytest.raises(VersionExistsError, match="v0"):
        store.publish_folder(0, saved, meta={"a": 2})
    assert store.read_manifest(0) == before


def test_partial_leftover_is_invisible_and_replaced(tmp_path, saved):
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    store.publish_folder(0, saved)
    (root / "v2").mkdir()
    (root / "v2" / "junk.bin").write_bytes(b"half a file")
    (root / "notaversion").mkdir()
    assert store.versions() == [0] and store.latest() == 0
    store.publish_folder(2, saved)
    assert not (root / "v2" / "junk.bin").exists()
    assert store.versions() == [0, 2]
    store.verify(2)


def test_verify_detects_corruption(tmp_path, saved):
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    store.publish_folder(0, saved)
    store.verify(0)
    weights = root / "v0" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors: sha256"):
        store.verify(0)
    weights.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors: size"):
        store.verify(0)
    (root / "v0" / "config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"config.json: missing"):
        store.verify(0)


def test_read_manifest_errors_name_url_and_problem(tmp_path, saved):
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    with pytest.raises(VersionNotFoundError, match=f"{root}/v3/manifest.json"):
        store.read_manifest(3)
    store.publish_folder(0, saved)
    store.publish_folder(1, saved)
    mpath = root / "v1" / "manifest.json"
    good = json.loads(mpath.read_text())
    mpath.write_text("{not json")
    with pytest.raises(ManifestError, match=r"v1/manifest.json: manifest is not valid JSON"):
        store.read_manifest(1)
    assert store.versions() == [0] and store.latest() == 0
    mpath.write_text(json.dumps({**good, "version": 5}))
    with pytest.raises(ManifestError, match="version 5 != 1"):
        store.read_manifest(1)
    mpath.write_text(json.dumps({**good, "files": [{"path": "../x", "size": 1, "sha256": "0" * 64}]}))
    with pytest.raises(ManifestError, match="bad file path"):
        store.read_manifest(1)
    with pytest.raises(ValueError):
        store.read_manifest(-1)


def test_prune_keeps_latest_and_deletes_manifest_first(tmp_path, saved, monkeypatch):
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    for v in range(4):
        store.publish_folder(v, saved)
    events = []
    real_rm_file, real_rm = store.fs.rm_file, store.fs.rm

    def rm_file(path, *a, **kw):
        events.append(("rm_file", os.path.relpath(path, root)))
        return real_rm_file(path, *a, **kw)

    def rm(path, *a, **kw):
        events.append(("rm", os.path.relpath(path, root)))
        return real_rm(path, *a, **kw)

    monkeypatch.setattr(store.fs, "rm_file", rm_file)
    monkeypatch.setattr(store.fs, "rm", rm)
    assert store.prune(2) == [0, 1]
    assert events == [("rm_file", "v0/manifest.json"), ("rm", "v0"), ("rm_file", "v1/manifest.json"), ("rm", "v1")]
    assert store.versions() == [2, 3]
    assert not (root / "v0").exists() and not (root / "v1").exists()
    assert store.prune(1) == [2]
    assert store.versions() == [3] and store.prune(1) == []
    with pytest.raises(ValueError):
        store.prune(0)


def test_manifest_is_the_last_object_written(tmp_path, saved, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    order = []
    real_put, real_pipe, real_replace = ckpt_mod.put_file_atomic, ckpt_mod.pipe_atomic, os.replace

    def put(fs, src, dest):
        order.append(("put", os.path.basename(dest)))
        real_put(fs, src, dest)

    def pipe(fs, path, data):
        order.append(("pipe", os.path.basename(path)))
        real_pipe(fs, path, data)

    def replace(src, dst):  # the moment each object becomes visible
        order.append(("visible", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod, "put_file_atomic", put)
    monkeypatch.setattr(ckpt_mod, "pipe_atomic", pipe)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    store.publish_folder(0, saved)
    files = sorted(os.listdir(saved))
    assert order[-2:] == [("pipe", "manifest.json"), ("visible", "manifest.json")]
    assert sorted(n for kind, n in order[:-2] if kind == "visible") == files
    assert sorted(n for kind, n in order[:-2] if kind == "put") == files


def test_local_copy_and_versions_refuse_missing(tmp_path):
    store = CheckpointStore(str(tmp_path / "nothing-here"))
    assert store.versions() == [] and store.latest() is None and store.prune(1) == []
    with pytest.raises(VersionNotFoundError):
        store.local_copy(0)


def test_atomic_helpers(tmp_path):
    p = tmp_path / "sub" / "state.json"
    write_json_atomic(str(p), {"a": [1, 2]})
    assert read_json(str(p)) == {"a": [1, 2]}
    write_json_atomic(f"file://{p}", {"a": 3})
    assert read_json(str(p)) == {"a": 3}
    write_text_atomic(str(tmp_path / "t.txt"), "héllo")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    write_bytes_atomic(str(tmp_path / "b.bin"), b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(p.parent)) == ["state.json"]  # no temp files left
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # the mode open() gives a new file here (the umask's): an atomic write's too
    assert {(tmp_path / n).stat().st_mode & 0o777 for n in ("t.txt", "b.bin", "sub/state.json")} == {
        plain.stat().st_mode & 0o777
    }
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON"):
        read_json(str(tmp_path / "bad.json"))


def test_retry_and_transient_classification():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    assert fsutil.is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert fsutil.is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert fsutil.is_transient(ConnectionResetError())
    assert fsutil.is_transient(ClientError({"Error": {"Code": "SlowDown"}}, "PutObject"))
    assert not fsutil.is_transient(
        ClientError({"Error": {"Code": "NoSuchBucket"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "PutObject")
    )
    assert not fsutil.is_transient(FileNotFoundError())
    assert not fsutil.is_transient(ValueError())
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("down")
        return "ok"

    assert fsutil.retry(flaky, retries=2, backoff_s=0.001) == "ok" and len(attempts) == 3
    attempts.clear()
    with pytest.raises(ConnectionError):
        fsutil.retry(flaky, retries=1, backoff_s=0.001)
    assert len(attempts) == 2


def test_extra_files_publish_with_the_version_and_are_checked(tmp_path, tokenizer):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.publish(0, make_model(1), tokenizer, extra={"resume/state.json": b'{"step": 0}', "resume/t.pt": b"\x00" * 10})
    names = [e["path"] for e in store.read_manifest(0)["files"]]
    assert "resume/state.json" in names and "resume/t.pt" in names
    assert store.read_file(0, "resume/state.json") == b'{"step": 0}'
    with pytest.raises(FileNotFoundError, match="no file 'resume/other'"):
        store.read_file(0, "resume/other")
    (tmp_path / "ckpt/v0/resume/t.pt").write_bytes(b"\x01" * 10)  # same size, other bytes
    with pytest.raises(CorruptCheckpointError, match=r"resume/t.pt"):
        store.read_file(0, "resume/t.pt")


def test_run_state_appears_with_its_version_or_not_at_all(tmp_path, tokenizer, monkeypatch):
    """A crash while publishing step 2 (its state written, its manifest not) leaves step 1's state."""
    from areal_core.run.metrics import RunLog
    from areal_core.storage import run_state

    store = CheckpointStore(str(tmp_path / "ckpt"))
    cfg = {"trainer": {"batch_size": 4}}
    model = make_model(1)
    runlog = RunLog(tmp_path / "run")
    for step in (0, 1):
        ctrl = {"n_submitted": 4 * step, "n_groups": step, "version": step, "groups": []}
        store.publish(
            step,
            model,
            tokenizer,
            extra=run_state.encode(
                step, cfg, ctrl, {"optimizer": {"x": torch.ones(2)}}, runlog.to_parquet_bytes(), None, CODE
            ),
        )

    real_pipe = ckpt_mod.pipe_atomic

    def crash_on_manifest(fs, path, data):
        if path.endswith("manifest.json"):
            raise KeyboardInterrupt("killed before the manifest")
        real_pipe(fs, path, data)

    monkeypatch.setattr(ckpt_mod, "pipe_atomic", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        store.publish(
            2,
            model,
            tokenizer,
            extra=run_state.encode(
                2,
                cfg,
                {"n_submitted": 8, "n_groups": 2, "version": 2, "groups": []},
                {},
                runlog.to_parquet_bytes(),
                None,
                CODE,
            ),
        )
    assert (tmp_path / "ckpt/v2/resume/state.json").exists()  # written, but not part of any version
    saved = run_state.load_latest(store, cfg)
    assert saved.version == 1 and saved.state["controller"]["n_groups"] == 1 and saved.state["code"] == CODE
    assert torch.equal(saved.trainer["optimizer"]["x"], torch.ones(2))
    with pytest.raises(run_state.ResumeError, match=r"trainer.batch_size"):
        run_state.load_latest(store, {"trainer": {"batch_size": 8}})
