"""Delta checkpoints (bit-exact through local_copy, full every K, prune keeps bases), S3, cadence config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_core.experiment import ConfigError, load_config
from areal_core.storage import CheckpointStore, CheckpointWriter, delta, ensure_bucket, snapshot_model
from areal_core.storage.config import StorageConfig, checkpoint_due
from infra.s3 import MotoS3Server
from tests.e2e.test_checkpoint_writer import assert_weights, tiny


def adamw_snapshots(n: int, seed: int = 0):
    """(tokenizer, [(tensors, files)] * n): the tiny model after each of n AdamW steps (lr 1.5e-4)."""
    model, tok = tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-4)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(snapshot_model(model, tok))
    return tok, out


def test_encode_decode_is_bit_exact_and_small_for_small_moves():
    gen = torch.Generator().manual_seed(0)
    base = {
        "a": torch.randn(1000, generator=gen),
        "b": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "same": torch.randn(50, generator=gen),
        "ids": torch.arange(10),
    }
    new = {
        "a": base["a"] * (1 + 1e-4 * torch.randn(1000, generator=gen)),
        "b": -base["b"],
        "same": base["same"].clone(),
        "ids": torch.arange(10).flip(0),
    }
    data = delta.encode(4, base, new)
    header, _ = delta.read_header(data, "x")
    assert header["base_version"] == 4 and header["tensors"]["same"]["planes"] == []
    out = delta.decode(data, base, "x")
    for name, t in new.items():  # bitwise: compare raw bytes, not float values
        assert out[name].dtype == t.dtype and torch.equal(out[name].view(torch.uint8), t.view(torch.uint8))
    # a 1e-4 relative move keeps sign, exponent and top mantissa bits: well under the 4000 raw bytes
    only_a = delta.encode(4, {"a": base["a"]}, {"a": new["a"]})
    assert len(only_a) < 0.75 * 4000
    with pytest.raises(ValueError, match="a does not match its sha256"):  # applied to the wrong base
        delta.decode(data, {**base, "a": base["a"] + 1}, "x")
    with pytest.raises(ValueError, match="names differ"):
        delta.encode(4, base, {"a": new["a"]})
    with pytest.raises(ValueError, match="not a delta file"):
        delta.decode(b"junk" * 10, base, "x")


def test_delta_round_trip_full_every_k_and_prune_keeps_bases(tmp_path):
    _tok, snaps = adamw_snapshots(7)
    expected = [{k: v.clone() for k, v in t.items()} for t, _ in snaps]
    store = CheckpointStore(str(tmp_path / "ckpt"))
    results = []
    with CheckpointWriter(store, format="delta", full_every=3, keep_last=2) as writer:
        for v, (tensors, files) in enumerate(snaps):
            results.append(writer.submit(v, tensors, files, meta={"step": v}).result(60))
    kinds = [(r.format, r.base_version) for r in results]
    assert kinds == [
        ("full", None),
        ("delta", 0),
        ("delta", 0),
        ("full", None),
        ("delta", 3),
        ("delta", 3),
        ("full", None),
    ]
    for r in results:
        if r.format == "delta":  # realistic AdamW moves: the XOR compresses
            assert r.weight_bytes < 0.8 * results[0].weight_bytes
    # keep_last 2 after v4 = [v3, v4]: v0 and v2 go. After v5 the kept [v4, v5] need base v3.
    assert [r.pruned for r in results] == [[], [], [], [1], [0, 2], [], [4]]
    assert store.versions() == [3, 5, 6]
    m5 = store.read_manifest(5)
    assert m5["meta"] == {"step": 5, "format": "delta", "base_version": 3}
    assert "model.safetensors" not in {f["path"] for f in m5["files"]}
    folder = store.local_copy(5)
    assert folder != store.version_url(5) and store.local_copy(5) == folder  # materialised once
    assert_weights(folder, expected[5])
    # the materialised weights file is byte-identical to a full checkpoint of the same weights
    full6 = Path(store.local_copy(6), "model.safetensors").read_bytes()
    assert load_file(os.path.join(folder, "model.safetensors")).keys() == expected[5].keys()
    with CheckpointWriter(CheckpointStore(str(tmp_path / "ref"))) as ref:
        ref.submit(0, {k: v.clone() for k, v in expected[5].items()}, snaps[5][1])
    assert Path(folder, "model.safetensors").read_bytes() == Path(tmp_path / "ref/v0/model.safetensors").read_bytes()
    assert full6 != Path(folder, "model.safetensors").read_bytes()
    assert set(os.listdir(folder)) == set(os.listdir(store.local_copy(6))) - {"manifest.json"}
    # pruning v5 also removes its materialised copy
    store.prune(1)
    assert store.versions() == [6] and not os.path.exists(folder)


def test_final_checkpoint_forced_full(tmp_path):
    _tok, snaps = adamw_snapshots(2, seed=1)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with CheckpointWriter(store, format="delta", full_every=10) as writer:
        assert writer.submit(0, *snaps[0]).result(60).format == "full"
        assert writer.submit(1, *snaps[1], full=True).result(60).format == "full"
    assert store.read_manifest(1)["meta"] == {"format": "full"}


@pytest.fixture(scope="module")
def s3():
    with MotoS3Server() as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env(fast_timeouts=True).items():
            mp.setenv(k, v)
        ensure_bucket("s3://areal-test")
        yield server


def test_delta_writer_over_s3(s3, tmp_path):
    _tok, snaps = adamw_snapshots(3, seed=2)
    expected = [{k: v.clone() for k, v in t.items()} for t, _ in snaps]
    url = "s3://areal-test/writer/ckpt"
    store = CheckpointStore(url, cache_dir=str(tmp_path / "wcache"))
    with CheckpointWriter(store, format="delta", full_every=3, keep_last=1) as writer:
        for v, (tensors, files) in enumerate(snaps):
            writer.submit(v, tensors, files, meta={"step": v})
    reader = CheckpointStore(url, cache_dir=str(tmp_path / "rcache"))
    assert reader.versions() == [0, 2] and reader.latest() == 2  # v0: the kept delta's base
    assert reader.read_manifest(2)["meta"]["base_version"] == 0
    reader.verify(2)
    folder = reader.local_copy(2)
    assert folder.startswith(str(tmp_path / "rcache"))
    assert_weights(folder, expected[2])
    assert_weights(reader.local_copy(0), expected[0])


def test_checkpoint_due():
    cfg = StorageConfig(checkpoint_every=3, checkpoint_every_s=60.0)
    assert checkpoint_due(1, None, None, 0.0, cfg)  # none taken yet
    assert not checkpoint_due(2, 0, 0.0, 10.0, cfg)
    assert checkpoint_due(3, 0, 0.0, 10.0, cfg)  # 3 steps
    assert checkpoint_due(1, 0, 0.0, 60.0, cfg)  # 60 s
    assert checkpoint_due(2, 0, 0.0, 1.0, cfg, final=True)
    assert not checkpoint_due(3, 3, 0.0, 1e9, cfg, final=True)  # never twice for a step
    assert not checkpoint_due(2, 0, 0.0, 1e9, StorageConfig(checkpoint_every=3))  # no time limit set


@pytest.mark.parametrize(
    "text, key",
    [
        ("storage:\n  checkpoint_every: 0\n", "storage.checkpoint_every"),
        ("storage:\n  checkpoint_every_s: -5\n", "storage.checkpoint_every_s"),
        ("storage:\n  format: zip\n", "storage.format"),
        ("storage:\n  full_every: 0\n", "storage.full_every"),
        ("storage:\n  checkpoint_every: '10'\n", "storage.checkpoint_every"),
    ],
)
def test_bad_storage_config_names_the_key(tmp_path, text, key):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(p)


def test_good_storage_config_loads(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("storage:\n  checkpoint_every: 5\n  checkpoint_every_s: 30\n  format: delta\n  full_every: 4\n")
    s = load_config(p).storage
    assert (s.checkpoint_every, s.checkpoint_every_s, s.format, s.full_every) == (5, 30.0, "delta", 4)


def test_prune_keeps_the_base_model_that_kept_lora_versions_are_made_against(tmp_path):
    _tok, snaps = adamw_snapshots(1)
    tensors, files = snaps[0]
    store = CheckpointStore(str(tmp_path / "ckpt"))
    adapters = {"layer.lora_A": torch.zeros(4, 8), "layer.lora_B": torch.zeros(8, 4)}
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj"], "base_version": 0}
    with CheckpointWriter(store, keep_last=1) as writer:
        writer.submit(0, tensors, files).result(60)  # the frozen base
        pruned = [
            writer.submit(v, {k: t + v for k, t in adapters.items()}, files, adapter_config=lora).result(60).pruned
            for v in (10, 20, 30)
        ]
    # keep_last 1: each new adapter version replaces the last one, never the base it is made against
    assert pruned == [[], [10], [20]] and store.versions() == [0, 30]
    assert store.read_manifest(30)["meta"]["base_version"] == 0
