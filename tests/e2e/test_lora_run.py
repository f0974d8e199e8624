"""LoRA in real runs: adapters reach every embedded server at every version (also a server
restarted mid-run), checkpoints hold adapters, export round-trips, resume keeps exactly-once."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

from areal_core.data.datasets import load_records, to_prompts
from areal_core.experiment import load_config
from areal_core.models import build_char_tokenizer
from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends.embedded import launcher
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.backends.embedded.engine import RolloutEngine
from areal_core.run.setup import run_experiment
from areal_core.storage import CheckpointStore
from areal_core.trainer import lora
from areal_core.trainer.export import export_checkpoint
from areal_core.trainer.packed_forward import response_logprobs

pytestmark = pytest.mark.nightly  # a LoRA run with servers and its resume: make test-nightly (CI runs it)

HERE = Path(__file__).resolve().parents[1]  # tests/
LORA = {"rank": 4, "alpha": 8.0}
PROBE = [5, 9, 12, 7, 20, 14, 11]  # a fixed prompt every server answers greedily at every version
PROBE_NEW = 8
WEIGHT = "model.layers.1.mlp.down_proj.weight"


class SimulatedCrash(Exception):
    pass


def lora_config(**overrides):
    # adv_norm none: every answer's reward is its advantage, so the adapters move at every step even
    # when the tiny model gets every answer wrong (normalised, a group of equal rewards trains nothing)
    return load_config(
        HERE / "data/e2e.yaml",
        {"trainer.lora": LORA, "trainer.optim.lr": 0.01, "trainer.adv_norm": "none", **overrides},
    )


async def _probe(url: str, version: int, timeout_s: float = 180.0) -> tuple[list[float], list[int], torch.Tensor]:
    """(logprobs, tokens, one merged weight) of the server at ``url`` once it serves ``version``."""
    c = EmbeddedClient(url, timeout_s=60)
    try:
        deadline = time.monotonic() + timeout_s
        while not (await c.health() and (await c.info()).weight_version == version):
            assert time.monotonic() < deadline, f"{url} did not reach version {version}"
            await asyncio.sleep(0.1)
        g = await c.generate(PROBE, Sampling(max_new_tokens=PROBE_NEW, temperature=0.0, ignore_eos=True))
        assert g.versions == [version] * PROBE_NEW  # sampled by exactly this version's weights
        w = torch.tensor(await c.weights_by_name(WEIGHT, truncate_size=1 << 20))
        return g.logprobs, g.output_ids, w
    finally:
        await c.aclose()


def trainer_merged(model: torch.nn.Module, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's merged model (a plain copy holding ``lora.merged_weights``): the probe's
    logprobs of ``tokens`` and the probed weight."""
    ref = copy.deepcopy(model)
    merged = lora.merged_weights(ref)
    with lora.without_adapters(ref), torch.no_grad():
        ref.load_state_dict(merged, strict=False)  # (a tied head is the embedding)
        lp = response_logprobs(ref, [PROBE + tokens], [len(PROBE)])
    return lp, merged[WEIGHT].flatten()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, request):
    """5 steps, 2 embedded servers, server 1 killed (SIGKILL) after step 2; every step each server
    is probed at the version just pushed and compared with the trainer's merged model."""
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    made: dict = {}

    class Servers(launcher.EmbeddedServers):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["servers"] = self

    real_apply = lora.apply_lora

    def apply_and_keep(model, *a, **k):
        made["model"] = model
        return real_apply(model, *a, **k)

    mp.setattr(launcher, "EmbeddedServers", Servers)
    mp.setattr(lora, "apply_lora", apply_and_keep)
    probes: dict[int, dict] = {}

    def on_step(row):
        v = row["version"]
        servers = made["servers"]
        got = [asyncio.run(_probe(url, v)) for url in servers.urls]
        want_lp, want_w = trainer_merged(made["model"], got[0][1])
        probes[v] = {
            "servers": got,
            "trainer_logprobs": want_lp,
            "trainer_weight": want_w,
            "bytes": row["weight_update_bytes"],
            "pids": [s.pid for s in servers.servers],
        }
        if v == 2:
            probes["killed_pid"] = servers.servers[1].pid
            os.kill(servers.servers[1].pid, signal.SIGKILL)  # the next push or request finds it gone

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cfg = lora_config(**{"rollout.n_servers": 2, "trainer.max_steps": 5})
    summary = run_experiment(
        cfg, run_dir, progress=False, on_step=on_step, cache_dir=str(tmp_path_factory.getbasetemp() / "warm")
    )  # its own (with the shared cache the
    # 5 steps at lr 0.01 once collapsed the policy to one answer for every prompt: whether the warm start ran here
    # or was loaded changes the random state the run starts from)
    return {"summary": summary, "probes": probes, "run_dir": run_dir, "made": made, "cfg": cfg}


@pytest.mark.slow
def test_adapters_reach_every_server_at_every_version(lora_run):
    probes, summary = lora_run["probes"], lora_run["summary"]
    assert summary["ledger_check"]["ok"], summary["ledger_check"]
    versions = [v for v in probes if isinstance(v, int)]
    assert versions == [1, 2, 3, 4, 5]
    for v in versions:
        (lp0, tok0, w0), (lp1, tok1, w1) = probes[v]["servers"]
        # both servers hold the same weights, bit for bit (server 1 restarted from the base after
        # version 2), the trainer's merged ones; their logprobs agree with each other and with the
        # trainer's to 1e-4 (a probe shares its server's batch with the run's requests, and the batch's
        # shape moves the last bits; the trainer's packed forward sums in another order)
        assert torch.equal(w0, w1), f"servers hold different weights at version {v}"
        assert torch.equal(w0, probes[v]["trainer_weight"]), f"version {v}: not the trainer's merged weight"
        assert tok0 == tok1
        for lp in (lp0, lp1):
            torch.testing.assert_close(torch.tensor(lp), probes[v]["trainer_logprobs"], atol=1e-4, rtol=0)
    for v in versions[1:]:  # new adapters every version: the answers' logprobs move with the version
        moved = (torch.tensor(probes[v]["servers"][0][0]) - torch.tensor(probes[v - 1]["servers"][0][0])).abs().max()
        assert moved > 1e-3, f"version {v} answers as {v - 1} did (max logprob change {moved:.2e})"
        assert not torch.equal(probes[v]["servers"][0][2], probes[v - 1]["servers"][0][2])
    # the restart: a new process for server 1, serving versions 3.. like server 0
    servers = lora_run["made"]["servers"]
    assert servers.restarts >= 1 and probes[3]["pids"][1] != probes["killed_pid"]


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_and_bytes_per_update_are_small(lora_run):
    run_dir, model = lora_run["run_dir"], lora_run["made"]["model"]
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.versions() == [0, 3, 5]
    v0 = {f["path"] for f in store.read_manifest(0)["files"]}  # the full base model
    assert "model.safetensors" in v0 and lora.ADAPTER_FILE not in v0
    for v in (3, 5):
        m = store.read_manifest(v)
        assert m["meta"]["format"] == "lora" and m["meta"]["base_version"] == 0
        assert not any(f["path"] == "model.safetensors" for f in m["files"])
    saved = load_safetensors(store.read_file(5, lora.ADAPTER_FILE))
    assert all(torch.equal(t, lora.adapter_tensors(model)[n]) for n, t in saved.items())  # the final adapters
    # bytes per weight update: the adapters, against every parameter of the model for full fine-tuning
    adapter_bytes = sum(t.nbytes for t in lora.adapter_tensors(model).values())
    with lora.without_adapters(model):
        full_bytes = sum(p.nbytes for p in model.parameters())
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert (metrics["weight_update_bytes"] == adapter_bytes).all()
    assert metrics["weight_push_s"].iloc[1:].notna().all()
    assert full_bytes > 5 * adapter_bytes, (full_bytes, adapter_bytes)


@pytest.mark.slow
def test_export_round_trips_through_plain_transformers(lora_run, tmp_path):
    """The exported folder, loaded by plain from_pretrained, answers 50 prompts greedily with the
    tokens the engine gives after receiving the run's last adapters."""
    run_dir, cfg = lora_run["run_dir"], lora_run["cfg"]
    out = export_checkpoint(str(run_dir), str(tmp_path / "exported"))
    assert sorted(p.name for p in Path(out).iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()

    store = CheckpointStore(str(run_dir / "checkpoints"))
    saved = load_safetensors(store.read_file(5, lora.ADAPTER_FILE))
    scale = LORA["alpha"] / LORA["rank"]
    wire = {n: lora.scaled_b(t, scale) if n.endswith(lora.B_SUFFIX) else t for n, t in saved.items()}
    engine = RolloutEngine.from_pretrained(store.local_copy(0), max_running=64)
    try:
        engine.update_weights_from_tensors(wire, 5, "test").result(timeout=60)
        prompts = [p.input_ids for p in to_prompts(load_records(cfg.data)[1][:50], build_char_tokenizer())]
        n_new = 24
        futs = [engine.submit(p, {"max_new_tokens": n_new, "temperature": 0.0}) for p in prompts]
        served = [f.result(timeout=300).output_ids for f in futs]
    finally:
        engine.shutdown()
    eos = hf.config.eos_token_id
    mismatched = []
    for p, want in zip(prompts, served):
        with torch.no_grad():
            out_ids = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n_new,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        got = out_ids[: out_ids.index(eos) + 1] if eos in out_ids else out_ids
        if got != want:
            mismatched.append((p, got, want))
    assert not mismatched, mismatched[:3]
    assert len({tuple(s) for s in served}) > 5  # the answers depend on the prompt


@pytest.mark.slow
def test_lora_run_resumes_exactly_once(tmp_path, warm_cache):
    """A synchronous LoRA run stopped after the checkpoint of step 2 resumes: trainer base from v0,
    adapters and optimizer from v2, servers given the adapters before generating (eta 0: every
    token of step 3's batch is version 2's; one sampled by the base would be labelled 0)."""
    cfg = lora_config(
        **{"trainer.eta": 0, "rollout.weight_update": "drain", "trainer.max_steps": 4, "storage.checkpoint_every": 2}
    )
    run_dir = tmp_path / "run"

    def crash(row):
        if row["step"] == 2:
            raise SimulatedCrash("stop after step 2")

    with pytest.raises(SimulatedCrash):
        run_experiment(cfg, run_dir, progress=False, cache_dir=warm_cache, on_step=crash)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.versions() == [0, 2] and store.read_manifest(2)["meta"]["format"] == "lora"
    v2 = load_safetensors(store.read_file(2, lora.ADAPTER_FILE))

    summary = run_experiment(cfg, run_dir, progress=False, cache_dir=warm_cache, resume=True)
    assert summary["resumed_from_step"] == 2 and summary["final_version"] == 4
    assert summary["ledger_check"]["ok"], summary["ledger_check"]
    ledger = pd.read_parquet(run_dir / "ledger.parquet")
    assert len(ledger) == 4 * cfg.trainer.batch_size and not ledger["trajectory_id"].duplicated().any()
    assert (ledger[ledger["step"] == 3]["min_token_version"] == 2).all()
    assert store.versions() == [0, 2, 4] and store.read_manifest(4)["meta"]["format"] == "lora"
    v4 = load_safetensors(store.read_file(4, lora.ADAPTER_FILE))
    assert any(not torch.equal(v4[n], v2[n]) for n in v2)  # training went on from v2's adapters
