"""LoRA without a run: the adapted forward, what trains, the one merge (engine, checkpoint,
export agree bit for bit), what the servers accept, and what travels."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from areal_core.rollout.backends.embedded.engine import RolloutEngine
from areal_core.rollout.backends.embedded.weight_receiver import check_weights
from areal_core.rollout.weight_transport import DiskTransport, TensorTransport, named_weights
from areal_core.run.checkpoints import restore_weights
from areal_core.storage import CheckpointStore, CheckpointWriter
from areal_core.storage.snapshot import snapshot_files
from areal_core.trainer import lora
from areal_core.trainer.config import LORA_TARGETS, LoraConfig, TrainerConfig
from areal_core.trainer.export import ExportError, export_checkpoint
from areal_core.trainer.packed_forward import response_logprobs
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory

RANK, ALPHA = 4, 8.0


def llama(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """A 2-layer random LlamaForCausalLM (untied head), weights large enough to matter."""
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=256,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.to(dtype)


def adapted(model: torch.nn.Module, seed: int = 0, b_std: float = 0.2) -> torch.nn.Module:
    """``model`` with adapters and a non-zero lora_B (as after some training)."""
    lora.apply_lora(model, RANK, ALPHA, LORA_TARGETS, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * b_std)
    return model


def merged_copy(model: torch.nn.Module, base: torch.nn.Module) -> torch.nn.Module:
    """A plain (adapter-free) copy of ``base`` holding ``model``'s merged weights."""
    ref = copy.deepcopy(base)
    ref.load_state_dict({**ref.state_dict(), **lora.merged_weights(model)})
    return ref


SEQS, STARTS = [[1, 5, 9, 7, 2, 8, 4], [1, 5, 9, 11, 3], [6, 6, 2, 9, 10, 12]], [3, 3, 2]


def test_config_section():
    assert TrainerConfig().lora is None  # full fine-tuning by default
    c = TrainerConfig.model_validate({"lora": {"rank": 8}})
    assert c.lora.rank == 8 and c.lora.alpha == 32.0 and c.lora.targets == list(LORA_TARGETS)
    with pytest.raises(ValueError, match="targets"):
        LoraConfig.model_validate({"targets": ["q_proj", "q_proj"]})
    with pytest.raises(ValueError):
        LoraConfig.model_validate({"targets": ["lm_head"]})
    with pytest.raises(ValueError):
        LoraConfig.model_validate({"rank": 0})


def test_config_refuses_lora_on_megatron():
    from areal_core.experiment import ExperimentConfig

    with pytest.raises(ValueError, match=r"trainer.lora: LoRA trains on the torch trainer only"):
        ExperimentConfig.model_validate({"trainer": {"backend": "megatron", "lora": {"rank": 4}}})


def test_adapted_forward_equals_the_merged_weights_forward():
    """The adapted model's packed forward (the trainer's) equals the plain model holding the merged
    weights, to 2e-5 in log-probabilities (float32: only the summation order differs)."""
    base = llama(1)
    model = adapted(copy.deepcopy(base))
    got = response_logprobs(model, SEQS, STARTS)
    want = response_logprobs(merged_copy(model, base), SEQS, STARTS)
    away = response_logprobs(base, SEQS, STARTS)
    assert (got - away).abs().max() > 1e-2  # the adapters do change the model
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # the HF forward of the adapted model too (its modules are called the same way)
    ids = torch.tensor([SEQS[0]])
    torch.testing.assert_close(model(ids).logits, merged_copy(model, base)(ids).logits, atol=2e-5, rtol=0)


def test_fresh_adapters_change_nothing_and_follow_the_seed():
    base = llama(2)
    m1, m2, m3 = (copy.deepcopy(base) for _ in range(3))
    a = lora.apply_lora(m1, RANK, ALPHA, LORA_TARGETS, seed=7)
    lora.apply_lora(m2, RANK, ALPHA, LORA_TARGETS, seed=7)
    lora.apply_lora(m3, RANK, ALPHA, LORA_TARGETS, seed=8)
    assert len(a) == 2 * len(LORA_TARGETS)
    t1, t2, t3 = (lora.adapter_tensors(m) for m in (m1, m2, m3))
    assert all(torch.equal(t1[n], t2[n]) for n in t1)  # the run seed decides lora_A
    assert not torch.equal(t1[a[0] + ".lora_A"], t3[a[0] + ".lora_A"])
    assert all(not t.any() for n, t in t1.items() if n.endswith(".lora_B"))
    assert all(t.dtype == torch.float32 for t in t1.values())
    for n, w in lora.merged_weights(m1).items():  # B = 0: the merge is the base, bit for bit
        assert torch.equal(w, base.state_dict()[n]), n


def test_only_adapters_get_gradients_and_train():
    base = llama(3)
    model = adapted(copy.deepcopy(base), b_std=0.0)
    response_logprobs(model, SEQS, STARTS).sum().backward()
    for name, p in model.named_parameters():
        if lora.is_adapter_name(name):
            assert p.requires_grad and p.grad is not None
        else:
            assert not p.requires_grad and p.grad is None, name
    # B = 0 at the start: A gets no gradient yet, B does
    assert all(m.lora_B.grad.abs().sum() > 0 for m in lora.lora_modules(model).values())
    model.zero_grad(set_to_none=True)

    trainer = Trainer(
        model, TrainerConfig(batch_size=2, optim={"lr": 1e-2, "weight_decay": 0.0}), temperature=1.0, total_steps=3
    )
    assert set(trainer.named_masters()) == set(lora.adapter_tensors(model))
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: t.clone() for n, t in lora.adapter_tensors(model).items()}
    batch = [
        Trajectory(
            traj_id=f"t{i}",
            group_id="g",
            seq_no=i,
            admit_version=0,
            prompt_ids=[1, 5, 9],
            reference="",
            task="chain",
            output_ids=[7, 2, 8],
            output_logprobs=[-1.0] * 3,
            output_versions=[0] * 3,
            reward=r,
            finish_reason="stop",
        )
        for i, r in enumerate((1.0, -1.0))
    ]
    trainer.step(batch, 0)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    moved = [n for n, t in lora.adapter_tensors(model).items() if not torch.equal(t, before[n])]
    assert moved and all(n.endswith(".lora_B") for n in moved)  # B was 0: A had no gradient in step 1 (no decay here)
    state = trainer.state_dict()["optimizer"]["state"]
    assert len(state) == len(before)  # optimizer state: the adapters' alone


def test_merge_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(384, 512, generator=g).to(torch.bfloat16)
    a, b = torch.randn(16, 512, generator=g), torch.randn(384, 16, generator=g) * 0.01
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lora.merge_weight(base, a, b)
        torch.set_num_threads(2)
        two = lora.merge_weight(base, a, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and one.dtype == torch.bfloat16


def _engine_weights(base_folder: str, updates: list[dict], dtype=torch.float32) -> dict[str, torch.Tensor]:
    engine = RolloutEngine.from_pretrained(base_folder, dtype=dtype, start=False)
    for v, named in enumerate(updates, 1):
        fut = engine.update_weights_from_tensors(named, v, "test")
        engine.step()
        fut.result(timeout=10)
    return {n: p.detach().clone() for n, p in engine.kv.model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_checkpoint_and_export_merge_bit_for_bit(tmp_path, dtype):
    """The engine's merge (from adapters sent with a pre-scaled B), the checkpoint's materialised
    folder, the export and the trainer's merged weights are the same bits; a second update merges
    into the captured base (not into the first update's weights)."""
    base = llama(4, dtype)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.publish(0, base, meta={"step": 0})
    model = adapted(copy.deepcopy(base), seed=5)
    first = lora.wire_adapters(model)
    first = {n: t.clone() for n, t in first.items()}
    with torch.no_grad():  # the trainer moves on: version 2 has other adapters
        for m in lora.lora_modules(model).values():
            m.lora_B.mul_(-3.0)
            m.lora_A.add_(0.01)
    with CheckpointWriter(store) as w:
        w.submit(
            2,
            {n: t.clone() for n, t in lora.adapter_tensors(model).items()},
            snapshot_files(model),
            meta={"step": 2},
            adapter_config=lora.adapter_config(model),
        ).result()
    manifest = store.read_manifest(2)
    assert manifest["meta"]["format"] == "lora" and manifest["meta"]["base_version"] == 0
    assert {f["path"] for f in manifest["files"]} >= {lora.ADAPTER_FILE, lora.ADAPTER_CONFIG}
    assert json.loads(store.read_file(2, lora.ADAPTER_CONFIG))["base_version"] == 0

    engine = _engine_weights(store.local_copy(0), [first, lora.wire_adapters(model)], dtype)
    trainer_merged = lora.merged_weights(model)
    from safetensors.torch import load_file

    materialised = load_file(f"{store.local_copy(2)}/model.safetensors")
    exported = load_file(f"{export_checkpoint(store.version_url(2), str(tmp_path / 'out'))}/model.safetensors")
    for name, want in trainer_merged.items():
        assert engine[name].dtype == dtype
        assert torch.equal(engine[name], want), name
        assert torch.equal(materialised[name], want), name
        assert torch.equal(exported[name], want), name
    assert store.local_copy(2) == store.local_copy(2)  # cached, like a delta version's
    assert store.prune(1) == [] and store.versions() == [0, 2]  # v0 is the LoRA versions' base: kept

    again = adapted(copy.deepcopy(base), seed=5)  # the resume path: base from v0, adapters from v2
    restore_weights(store, again, 2)
    assert all(torch.equal(t, lora.adapter_tensors(model)[n]) for n, t in lora.adapter_tensors(again).items())


def test_servers_refuse_bad_adapters_by_name():
    model = llama(6)
    good = lora.wire_adapters(adapted(llama(6)))
    q = "model.layers.0.self_attn.q_proj"
    assert check_weights(model, good, "t") is not None
    with pytest.raises(ValueError, match="lora_A without lora_B"):
        check_weights(model, {q + ".lora_A": good[q + ".lora_A"]}, "t")
    with pytest.raises(ValueError, match=r"do not fit its weight \(64, 64\)"):
        check_weights(model, {q + ".lora_A": torch.zeros(4, 63), q + ".lora_B": torch.zeros(64, 4)}, "t")
    with pytest.raises(ValueError, match="adapters are float32"):
        check_weights(
            model, {q + ".lora_A": torch.zeros(4, 64, dtype=torch.bfloat16), q + ".lora_B": torch.zeros(64, 4)}, "t"
        )
    with pytest.raises(ValueError, match=r"no linear weight model.layers.0.nope.weight"):
        check_weights(
            model,
            {"model.layers.0.nope.lora_A": torch.zeros(4, 64), "model.layers.0.nope.lora_B": torch.zeros(64, 4)},
            "t",
        )
    with pytest.raises(ValueError, match="adapters only or full weights only"):
        check_weights(model, {**good, "lm_head.weight": model.lm_head.weight.detach()}, "t")


def test_a_server_holding_another_versions_full_weights_refuses_adapters(tmp_path):
    """Adapters are made against v0: a server started from a merged checkpoint (v5's full weights)
    refuses them by name, instead of merging them into weights that already hold adapters; one that
    holds v0 takes them, and after full weights of v7 arrive it refuses again."""
    base = llama(6)
    base.save_pretrained(tmp_path / "m")
    wire = lora.wire_adapters(adapted(llama(6), seed=2))
    merged = RolloutEngine.from_pretrained(str(tmp_path / "m"), weight_version=5, start=False)
    with pytest.raises(ValueError, match=r"made against checkpoint v0.*holds the full weights of v5: restart it"):
        merged.update_weights_from_tensors(wire, 6, "push")
    fresh = RolloutEngine.from_pretrained(str(tmp_path / "m"), weight_version=0, start=False)
    fut = fresh.update_weights_from_tensors(wire, 1, "push")
    fresh.step()
    fut.result(timeout=10)
    fut = fresh.update_weights_from_tensors({n: p.detach() for n, p in base.named_parameters()}, 7, "full")
    fresh.step()
    fut.result(timeout=10)
    with pytest.raises(ValueError, match="holds the full weights of v7"):
        fresh.update_weights_from_tensors(wire, 8, "push")


def test_what_a_model_sends():
    """A LoRA model sends its adapters (B pre-scaled) to servers that merge, merged full weights to
    the others; a full model its parameters. Bytes per update: adapters are a small fraction."""
    base = llama(7)
    model = adapted(copy.deepcopy(base))
    sent = named_weights(model)
    assert set(sent) == set(lora.adapter_tensors(model))
    q = lora.lora_modules(model)["model.layers.0.self_attn.q_proj"]
    assert torch.equal(sent["model.layers.0.self_attn.q_proj.lora_B"], q.lora_B * (ALPHA / RANK))
    full = named_weights(model, adapters=False)
    assert set(full) == set(named_weights(base)) and all(not lora.is_adapter_name(n) for n in full)
    # servers computing in bfloat16 (rollout.dtype): adapters still travel in float32 (the server
    # merges them into its own weights); whole weights travel rounded
    for name, t in named_weights(model, dtype=torch.bfloat16).items():
        assert t.dtype == torch.float32 and torch.equal(t, sent[name])
    rounded = named_weights(model, adapters=False, dtype=torch.bfloat16)
    assert all(torch.equal(rounded[n], t.to(torch.bfloat16)) for n, t in full.items())
    t_full, t_lora = TensorTransport(), TensorTransport()
    try:
        t_full.stage(base, 1)
        t_lora.stage(model, 1)
        assert t_lora.staged_bytes == sum(t.nbytes for t in sent.values())
        assert t_full.staged_bytes == sum(p.nbytes for p in base.parameters())
        assert t_lora.staged_bytes * 3 < t_full.staged_bytes
    finally:
        t_full.close()
        t_lora.close()


def test_disk_transport_writes_merged_weights(tmp_path):
    base = llama(8)
    model = adapted(copy.deepcopy(base))
    t = DiskTransport(str(tmp_path / "w"))
    t.stage(model, 3)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w/v3"))
    want = lora.merged_weights(model)
    got = dict(loaded.named_parameters())
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert lora.is_lora(model) and set(lora.adapter_tensors(model))  # the model keeps its adapters


def test_export_refuses_a_non_empty_folder_and_bad_sources(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full/x").write_text("x")
    with pytest.raises(ExportError, match="already exists and is not an empty folder"):
        export_checkpoint(str(tmp_path), str(tmp_path / "full"))
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_checkpoint(str(tmp_path), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    with pytest.raises(ExportError, match="give a checkpoint version"):
        export_checkpoint(str(tmp_path / "missing"), str(tmp_path / "new"))


def test_export_of_a_full_checkpoint_loads_with_plain_transformers(tmp_path):
    base = llama(9)
    store = CheckpointStore(str(tmp_path / "run/checkpoints"))
    store.publish(0, base, meta={"step": 0}, extra={"resume/state.json": b"{}"})
    out = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "model"))  # the run's latest
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, base.state_dict()[n]) for n, p in loaded.named_parameters())


def test_a_lora_checkpoint_exported_for_peft_loads_with_peft_and_answers_as_the_merged_export(tmp_path):
    """export --peft: v0 as the base and the version's adapters in PEFT's format, which
    PeftModel.from_pretrained loads; its logits are the merged export's (the same scale alpha / r)."""
    from peft import PeftModel

    from areal_core.trainer.export import export_peft
    from flows.cli import main

    base = llama(6)
    store = CheckpointStore(str(tmp_path / "run/checkpoints"))
    store.publish(0, base, meta={"step": 0})
    model = adapted(copy.deepcopy(base), seed=7)
    with CheckpointWriter(store) as w:
        w.submit(
            3,
            lora.adapter_tensors(model),
            snapshot_files(model),
            meta={"step": 3},
            adapter_config=lora.adapter_config(model),
        ).result()
    out = tmp_path / "peft"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--peft"]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), str(out / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(store.version_url(3), str(tmp_path / "merged")))
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        want, got = merged(ids).logits, peft_model(ids).logits
    # (the merge and the unmerged forward round differently: agreement to float32 rounding, not bits)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4) and not torch.allclose(got, base(ids).logits, atol=1e-2)
    cfg = json.loads((out / "adapter/adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
    with pytest.raises(ExportError, match="holds full weights, not adapters"):
        export_peft(store.version_url(0), str(tmp_path / "nope"))


def test_cli_export_prints_the_folder_and_refuses_in_one_line(tmp_path, capsys):
    from flows.cli import main

    store = CheckpointStore(str(tmp_path / "run/checkpoints"))
    store.publish(0, llama(10), meta={"step": 0})
    assert main(["export", str(tmp_path / "run/checkpoints/v0"), "--out", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "not an empty folder" in err


@pytest.mark.slow
def test_transports_bring_a_server_the_merged_weights(tmp_path):
    """Adapters by the tensor and the distributed transports, and merged full weights by the
    distributed one (what SGLang's endpoint takes): the server ends with the trainer's merged weights
    bit for bit, version after version."""
    from areal_core.rollout.backends.embedded.client import EmbeddedClient
    from areal_core.rollout.backends.embedded.launcher import EmbeddedServers
    from areal_core.rollout.weight_transport import DistributedTransport

    base = llama(11)
    base.save_pretrained(tmp_path / "v0")
    model = adapted(copy.deepcopy(base))
    name = "model.layers.1.self_attn.o_proj.weight"

    async def push(transport, url, version):
        c = EmbeddedClient(url)
        try:
            await transport.connect([c])
            transport.stage(model, version)
            await transport.push([c])
            assert (await c.model_info()).weight_version == version
            return torch.tensor(await c.weights_by_name(name, truncate_size=1 << 20))
        finally:
            await c.aclose()

    with EmbeddedServers(str(tmp_path / "v0"), 1, log_paths=[str(tmp_path / "s.log")]) as servers:
        url, version = servers.urls[0], 0
        for make in (TensorTransport, DistributedTransport, lambda: _full(DistributedTransport())):
            t = make()
            try:
                for _ in range(2):
                    version += 1
                    with torch.no_grad():  # the trainer moves on
                        for m in lora.lora_modules(model).values():
                            m.lora_B.add_(0.05)
                    got = asyncio.run(push(t, url, version))
                    assert torch.equal(got, lora.merged_weights(model)[name].flatten()), (type(t).__name__, t.adapters)
                    assert (t.staged_bytes < 0.5 * sum(p.nbytes for p in base.parameters())) == t.adapters
            finally:
                t.close()


def _full(t):
    t.adapters = False  # a LoRA model then sends merged full weights
    return t
