"""Bad input everywhere (property-based): configs, dataset rows, checkpoint manifests and the
rollout server's HTTP bodies. Each gets a clear error naming the problem, never a crash of
the server, and never a half-written file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, Qwen2Config

from areal_core.data.records import RecordError, read_records
from areal_core.experiment import ConfigError, load_config
from areal_core.rollout.backends.embedded.engine import RolloutEngine
from areal_core.rollout.backends.embedded.server import create_app
from areal_core.storage.checkpoints import (
    CheckpointStore,
    CorruptCheckpointError,
    ManifestError,
    VersionNotFoundError,
)

HERE = Path(__file__).resolve().parents[1]  # tests/
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12,
)


# -- configs ------------------------------------------------------------------------
BASE = yaml.safe_load((HERE / "data/e2e.yaml").read_text())
KEYS = [f"{s}.{k}" for s, sec in BASE.items() if isinstance(sec, dict) for k in sec] + [
    "trainer.eta",
    "trainer.batch_size",
    "rollout.n_samples",
    "storage.keep_last",
    "nonsense.key",
    "seed",
]


@FAST
@given(overrides=st.dictionaries(st.sampled_from(KEYS), json_values, min_size=1, max_size=3))
def test_config_overrides_valid_or_named_error(tmp_path_factory, overrides):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    try:
        load_config(path, overrides)
    except ConfigError as e:
        msg = str(e)
        # blames the file or the --set that set the value
        assert str(path) in msg or "override" in msg or any(f"--set {k}=" in msg for k in overrides), msg
        assert any(k.split(".")[-1] in msg or k.split(".")[0] in msg for k in overrides), (overrides, msg)


@FAST
@given(text=st.one_of(st.text(max_size=200), json_values.map(yaml.safe_dump)))
def test_config_files_valid_or_named_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e), str(e)


# -- dataset rows --------------------------------------------------------------------
record_like = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values,
        "task": st.sampled_from(["chain", "math", "code", "poem", 3]),
        "prompt": json_values,
        "answer": json_values,
        "solution": json_values,
        "tests": json_values,
        "meta": json_values,
        "extra": json_values,
    },
)


@FAST
@given(rows=st.lists(st.one_of(record_like, json_values), min_size=1, max_size=5))
def test_dataset_rows_valid_or_named_error(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        records = read_records(str(path))
    except RecordError as e:
        msg = str(e)
        assert str(path) in msg and "line " in msg, msg
    else:
        assert len(records) == len(rows)


@FAST
@given(lines=st.lists(st.binary(max_size=40), min_size=1, max_size=4))
def test_dataset_garbage_lines_named_error(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        read_records(str(path))
    except RecordError as e:
        assert str(path) in str(e)


# -- checkpoint manifests -------------------------------------------------------------
GOOD = {
    "format": "areal-checkpoint/1",
    "version": 0,
    "created": "2026-01-01T00:00:00+00:00",
    "created_unix": 0.0,
    "meta": {},
    "files": [{"path": "model.safetensors", "size": 4, "sha256": "0" * 64}],
}


def _mutations():
    fields = st.sampled_from(["format", "version", "created", "meta", "files"])
    entry_fields = st.sampled_from(["path", "size", "sha256"])
    whole = json_values
    field = st.tuples(st.just("field"), fields, json_values)
    entry = st.tuples(
        st.just("entry"),
        entry_fields,
        st.one_of(
            json_values, st.sampled_from(["../x", "/etc/passwd", "manifest.json", "a\\b", "", -1, 2**64, "A" * 64])
        ),
    )
    return st.one_of(st.tuples(st.just("whole"), whole, st.none()), field, entry)


@FAST
@given(mutation=_mutations())
def test_bad_manifests_named_error(tmp_path_factory, mutation):
    root = tmp_path_factory.mktemp("store")
    (root / "v0").mkdir()
    (root / "v0/model.safetensors").write_bytes(b"abcd")
    kind, key, value = mutation
    m = json.loads(json.dumps(GOOD))
    if kind == "whole":
        m = key
    elif kind == "field":
        m[key] = value
    else:
        m["files"][0][key] = value
    (root / "v0/manifest.json").write_text(json.dumps(m))
    store = CheckpointStore(str(root))
    try:
        store.verify(0)
    except ManifestError as e:
        assert ("v0/manifest.json" in str(e) and "invalid manifest" in str(e)) or "not valid JSON" in str(e)
        assert store.versions() == []  # an invalid manifest means: no such version
    except CorruptCheckpointError as e:
        assert "model.safetensors" in str(e) or "missing" in str(e)


@FAST
@given(raw=st.binary(max_size=200))
def test_garbage_manifest_bytes(tmp_path_factory, raw):
    root = tmp_path_factory.mktemp("store")
    (root / "v3").mkdir()
    (root / "v3/manifest.json").write_bytes(raw)
    store = CheckpointStore(str(root))
    with pytest.raises((ManifestError, VersionNotFoundError)):
        store.read_manifest(3)
    assert store.latest() is None


def test_bad_extra_file_names_write_nothing(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    for name in ("../escape", "/abs", "manifest.json", ""):
        with pytest.raises(ValueError, match="extra file"):
            store.publish(1, _model(), extra={name: b"x"})
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []


# -- the rollout server's HTTP inputs ---------------------------------------------------
VOCAB = 64


def _model():
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.fixture(scope="module")
def http():
    engine = RolloutEngine(_model(), max_running=8)
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield client, engine
    engine.shutdown()


sampling_like = st.fixed_dictionaries(
    {},
    optional={
        "temperature": json_values,
        "top_p": json_values,
        "top_k": json_values,
        "max_new_tokens": st.one_of(json_values, st.integers(-5, 10**9)),
        "stop_token_ids": json_values,
        "ignore_eos": json_values,
        "sampling_seed": st.one_of(json_values, st.integers(-5, 2**64)),
        "bogus": json_values,
    },
)
generate_like = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.one_of(json_values, st.lists(st.integers(-10, 2**66), max_size=6)),
        "sampling_params": st.one_of(sampling_like, json_values),
        "rid": json_values,
        "return_logprob": json_values,
    },
)


def _post(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@FAST
@given(
    body=st.one_of(generate_like, json_values, st.binary(max_size=60)),
    path=st.sampled_from(["/generate", "/update_weights_from_disk", "/pause_generation"]),
)
def test_server_http_bad_bodies(http, body, path):
    client, engine = http
    if path == "/generate" and isinstance(body, dict) and isinstance(body.get("sampling_params"), dict):
        mnt = body["sampling_params"].get("max_new_tokens")
        if isinstance(mnt, int) and not isinstance(mnt, bool) and mnt > 0:
            body["sampling_params"]["max_new_tokens"] = min(mnt, 4)  # keep the valid ones short
    r = _post(client, path, body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        msg = r.json()["message"]
        assert msg and isinstance(msg, str)
    if path == "/pause_generation" and r.status_code == 200:
        assert _post(client, "/continue_generation", {}).status_code == 200
    assert engine.alive()


def test_server_still_serves_after_bad_input(http):
    client, engine = http
    for body in (
        b"{",
        b"\xff\xfe",
        b"[]",
        b'{"input_ids": {}}',
        b'{"input_ids": [1e400]}',
        b'{"input_ids": [99999]}',
        json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}).encode(),
        json.dumps({"input_ids": [1] * 70000}).encode(),
        b"0" * (9 << 20),
    ):
        r = _post(client, "/generate", body)
        assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text[:200])
        assert r.json()["message"]
    r = _post(client, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and 1 <= len(r.json()["output_ids"]) <= 3
    assert client.get("/get_requests").json()["requests"] == []
    assert engine.alive()
