"""CheckpointWriter: background writes, manifest last, errors surface, kills leave the previous version."""

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
from safetensors.torch import load_file

from areal_core.rollout.backends.embedded.kv_forward import read_weights
from areal_core.storage import CheckpointStore, CheckpointWriteError, CheckpointWriter, snapshot_model
from areal_core.storage import checkpoints as ckpt_mod

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def tiny(seed: int):
    """(model, tokenizer): the tiny Qwen2 with tied embeddings, small."""
    from areal_core.models import build_char_tokenizer, build_tiny
    from areal_core.models.config import TinyArch

    tok = build_char_tokenizer()
    return build_tiny(TinyArch(**SMALL), tok, seed), tok


def load(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def assert_weights(folder: str, expected: dict[str, torch.Tensor]) -> None:
    """The folder loads with from_pretrained and read_weights, with exactly ``expected``'s values."""
    model = load(folder)
    state = model.state_dict()
    for name, t in expected.items():
        assert torch.equal(state[name], t), name
    staged = read_weights(model, folder)
    for name, t in staged.items():
        assert torch.equal(t, expected[name]), name


def test_snapshot_is_what_save_pretrained_writes(tmp_path):
    model, tok = tiny(0)
    assert model.config.tie_word_embeddings
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tensors, files = snapshot_model(model, tok)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert tensors.keys() == on_disk.keys() and "lm_head.weight" not in tensors
    for name, t in tensors.items():
        assert torch.equal(t, on_disk[name]), name
    assert set(files) | {"model.safetensors"} == set(os.listdir(tmp_path))
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data, name
    # a snapshot is a copy: training may mutate the live weights
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(tensors["model.embed_tokens.weight"], on_disk["model.embed_tokens.weight"])


def test_written_checkpoint_loads_and_carries_its_files(tmp_path):
    model, tok = tiny(1)
    tensors, files = snapshot_model(model, tok)
    expected = {k: v.clone() for k, v in tensors.items()}
    store = CheckpointStore(str(tmp_path / "ckpt"))
    published = []
    with CheckpointWriter(store, on_published=published.append) as writer:
        future = writer.submit(3, tensors, {**files, "resume/state.json": b'{"step": 3}'}, meta={"step": 3})
    result = future.result()
    assert published == [result] and result.version == 3 and result.format == "full"
    assert store.latest() == 3 and store.read_manifest(3)["meta"] == {"step": 3, "format": "full"}
    assert store.read_file(3, "resume/state.json") == b'{"step": 3}'
    store.verify(3)
    assert_weights(store.local_copy(3), expected)
    assert result.bytes_written == sum(e["size"] for e in store.read_manifest(3)["files"])
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.startswith(".staging-")]  # cleaned on close


def test_the_trainer_state_is_the_one_encoded_though_training_goes_on_while_it_is_written(tmp_path):
    """run_state.encode copies the trainer's state and the writer serializes the copy into its file:
    a step that changes the live tensors in place after encode (while the write runs) leaves the
    checkpoint as it was at encode, and a resume reads it back."""
    from areal_core.run.metrics import RunLog
    from areal_core.storage import run_state

    model, tok = tiny(2)
    tensors, files = snapshot_model(model, tok)
    moments = torch.arange(6, dtype=torch.float32)
    live = {"optimizer": {"state": {0: {"exp_avg": moments}}}, "master_weights": {"w": moments[:3]}}
    cfg = {"trainer": {"batch_size": 4}}
    resume = run_state.encode(
        3, cfg, {"n_submitted": 4}, live, RunLog(tmp_path / "run").to_parquet_bytes(), None, {"commit": "x"}
    )
    assert callable(resume[run_state.TRAINER])  # serialized on the writer's thread, into the file
    moments.add_(100.0)  # the next step, before the write
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with CheckpointWriter(store) as writer:
        writer.submit(3, tensors, {**files, **resume}, meta={"step": 3})
    saved = run_state.load_latest(store, cfg)
    assert saved.version == 3 and saved.state["controller"] == {"n_submitted": 4}
    assert torch.equal(saved.trainer["optimizer"]["state"][0]["exp_avg"], torch.arange(6, dtype=torch.float32))
    assert torch.equal(saved.trainer["master_weights"]["w"], torch.arange(3, dtype=torch.float32))
    store.verify(3)


def _block_after_first_file(monkeypatch, reached: threading.Event, release: threading.Event):
    real = ckpt_mod.move_file_atomic

    def move(fs, src, dest):
        real(fs, src, dest)
        reached.set()
        assert release.wait(60), "the test never released the write"

    monkeypatch.setattr(ckpt_mod, "move_file_atomic", move)


def test_checkpoint_in_progress_is_never_visible_and_submit_waits(tmp_path, monkeypatch):
    model, tok = tiny(2)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    writer = CheckpointWriter(store)
    writer.submit(0, *snapshot_model(model, tok), meta={"step": 0})
    writer.flush()
    reached, release = threading.Event(), threading.Event()
    _block_after_first_file(monkeypatch, reached, release)
    future = writer.submit(1, *snapshot_model(model, tok), meta={"step": 1})
    assert reached.wait(60)
    # mid-write: a file of v1 is in place, its manifest is not; every reader still sees v0
    assert os.listdir(tmp_path / "ckpt" / "v1") and not (tmp_path / "ckpt" / "v1" / "manifest.json").exists()
    for reader in (store, CheckpointStore(str(tmp_path / "ckpt"))):
        assert reader.latest() == 0 and reader.versions() == [0]
    assert not future.done()
    # a third submit blocks until the write in flight is done
    third = threading.Thread(target=lambda: writer.submit(2, *snapshot_model(model, tok)))
    third.start()
    third.join(0.5)
    assert third.is_alive()
    release.set()
    third.join(60)
    assert not third.is_alive() and writer.last_wait_s > 0
    assert future.result().version == 1
    writer.close()
    assert store.versions() == [0, 1, 2]


def test_failed_write_is_raised_at_the_next_submit_and_flush(tmp_path, monkeypatch):
    model, tok = tiny(3)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    writer = CheckpointWriter(store)
    real = ckpt_mod.move_file_atomic

    def denied(fs, src, dest):
        raise PermissionError(f"denied: {dest}")

    monkeypatch.setattr(ckpt_mod, "move_file_atomic", denied)
    failed = writer.submit(0, *snapshot_model(model, tok))
    assert isinstance(failed.exception(60), PermissionError)
    monkeypatch.setattr(ckpt_mod, "move_file_atomic", real)
    with pytest.raises(CheckpointWriteError, match="denied") as err:
        writer.submit(1, *snapshot_model(model, tok))
    assert isinstance(err.value.__cause__, PermissionError)
    assert store.versions() == []  # v0 failed and v1 was not queued
    writer.submit(1, *snapshot_model(model, tok)).result(60)
    monkeypatch.setattr(ckpt_mod, "move_file_atomic", denied)
    writer.submit(2, *snapshot_model(model, tok))
    with pytest.raises(CheckpointWriteError, match="denied"):
        writer.close()
    assert store.versions() == [1]


def test_bad_submissions_are_refused(tmp_path):
    model, tok = tiny(4)
    tensors, files = snapshot_model(model, tok)
    with CheckpointWriter(CheckpointStore(str(tmp_path / "ckpt"))) as writer:
        with pytest.raises(ValueError, match="'format' is set by the writer"):
            writer.submit(0, tensors, files, meta={"format": "x"})
        with pytest.raises(ValueError, match=r"model.safetensors"):
            writer.submit(0, tensors, {**files, "model.safetensors": b""})
        with pytest.raises(ValueError, match=r"'../x'"):
            writer.submit(0, tensors, {**files, "../x": b""})
        with pytest.raises(ValueError, match="version must be an int"):
            writer.submit(-1, tensors, files)
    with pytest.raises(ValueError, match="format must be"):
        CheckpointWriter(CheckpointStore(str(tmp_path / "c2")), format="zip")


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from areal_core.storage import CheckpointStore, CheckpointWriter, snapshot_model
    from areal_core.storage import checkpoints
    sys.path.insert(0, "tests")
    from tests.e2e.test_checkpoint_writer import tiny
    url, marker = sys.argv[1], Path(sys.argv[2])
    writer = CheckpointWriter(CheckpointStore(url))
    model, tok = tiny(5)
    writer.submit(0, *snapshot_model(model, tok)).result()
    real = checkpoints.move_file_atomic
    def move_then_hang(fs, src, dest):
        real(fs, src, dest)
        marker.write_text("mid-write")
        time.sleep(600)
    checkpoints.move_file_atomic = move_then_hang
    model2, _ = tiny(6)
    writer.submit(1, *snapshot_model(model2, tok))
    time.sleep(600)
""")


def test_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    url, marker = str(tmp_path / "ckpt"), tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, url, str(marker)], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no marker in 120 s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    partial = tmp_path / "ckpt" / "v1"
    assert partial.is_dir() and os.listdir(partial) and not (partial / "manifest.json").exists()
    store = CheckpointStore(url)
    assert store.latest() == 0 and store.versions() == [0]
    model, tok = tiny(5)
    expected, _ = snapshot_model(model, tok)
    assert_weights(store.local_copy(0), expected)
    # a new writer removes the dead writer's staging folder and writes v1 over the partial one
    stale = [n for n in os.listdir(url) if n.startswith(".staging-")]
    assert stale
    model2, _ = tiny(6)
    tensors, files = snapshot_model(model2, tok)
    expected2 = {k: v.clone() for k, v in tensors.items()}
    with CheckpointWriter(store) as writer:
        assert not set(stale) & set(os.listdir(url))
        writer.submit(1, tensors, files)
    assert store.latest() == 1
    assert_weights(store.local_copy(1), expected2)
