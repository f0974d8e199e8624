"""The engine's weights-only model (models/decoder_weights.py) against the Hugging Face model that
transformers loads from the same folder: the same parameters (names, shapes, dtypes, values, ties),
the same rotary table bit for bit, the same EOS ids and weight digest, and the same logits through
the engine's forward."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from areal_core.models.decoder import UnsupportedModelError, check_decoder, rope_table
from areal_core.models.decoder_weights import PLAIN_KEYS, DecoderWeights, load_decoder_weights, load_served_model
from areal_core.models.digest import weights_sha256
from areal_core.models.weights import eos_token_ids, load_model
from areal_core.rollout.backends.embedded.kv_forward import KVForward
from tests.unit.test_engine import tiny_model
from tests.unit.test_engine_forward import CONT, PROMPTS, run_kv

CASES = [
    ("llama", {}),  # tied embeddings
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2", {}),  # q/k/v biases, untied
    (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    ("mistral", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
]


def saved(tmp_path, arch: str, extra: dict) -> str:
    model = tiny_model(arch, seed=5, **extra)
    with torch.no_grad():  # biases away from zero, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5)
    model.generation_config.eos_token_id = [3, 7]
    model.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch,extra", CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def test_the_weights_only_model_is_the_hugging_face_model_for_the_engine(tmp_path, arch, extra, dtype):
    folder = saved(tmp_path, arch, extra)
    hf, ours = load_model(folder, dtype), load_decoder_weights(folder, dtype)
    assert isinstance(ours, DecoderWeights)
    # a default rotary table: the config read from config.json alone, with transformers' values
    assert isinstance(ours.config, SimpleNamespace) == ("rope_parameters" not in extra)
    for key in (*PLAIN_KEYS, "num_key_value_heads", "attention_bias", "mlp_bias"):
        assert getattr(ours.config, key, False) == getattr(hf.config, key, False), key
    ours_named = dict(ours.named_parameters(remove_duplicate=False))
    hf_named = dict(hf.named_parameters(remove_duplicate=False))
    assert sorted(ours_named) == sorted(hf_named)
    for name, p in hf_named.items():
        q = ours_named[name]
        assert (q.shape, q.dtype) == (p.shape, p.dtype), name
        assert torch.equal(q, p), name
    ties = lambda m: {n for n, _ in m.named_parameters(remove_duplicate=False)} - set(dict(m.named_parameters()))  # noqa: E731
    assert ties(ours) == ties(hf)
    assert weights_sha256(ours) == weights_sha256(hf)  # the digest the servers report (state_dict keys too)
    assert eos_token_ids(ours) == eos_token_ids(hf) == [3, 7]
    assert ours.model.rotary_emb.rope_type == hf.model.rotary_emb.rope_type
    positions = torch.arange(0, 300)
    assert torch.equal(
        rope_table(ours.model.rotary_emb, positions, dtype), rope_table(hf.model.rotary_emb, positions, dtype)
    )
    a, b = KVForward(hf, max_slots=4), KVForward(ours, max_slots=4)
    assert torch.equal(run_kv(a, PROMPTS, CONT), run_kv(b, PROMPTS, CONT))


def test_a_model_it_does_not_describe_is_loaded_by_transformers(tmp_path):
    model = tiny_model("llama", seed=5, hidden_act="gelu")
    model.save_pretrained(tmp_path)
    assert load_decoder_weights(str(tmp_path), torch.float32) is None
    served = load_served_model(str(tmp_path), torch.float32)
    assert type(served).__name__ == "LlamaForCausalLM"


def test_a_checkpoint_missing_a_tensor_is_refused_with_its_name(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = saved(tmp_path, "qwen2", {})
    tensors = load_file(f"{folder}/model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.self_attn\.k_proj\.bias"):
        load_decoder_weights(folder, torch.float32)


def test_a_config_that_leaves_a_key_to_its_default_is_read_by_transformers(tmp_path):
    folder = saved(tmp_path, "qwen2", {})
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    del raw["hidden_act"]  # (a default that transformers' config class supplies)
    path.write_text(json.dumps(raw))
    ours, hf = load_decoder_weights(folder, torch.float32), load_model(folder, torch.float32)
    assert not isinstance(ours.config, SimpleNamespace) and ours.config.hidden_act == "silu"
    assert weights_sha256(ours) == weights_sha256(hf)


def test_a_mistral_with_a_sliding_window_is_refused_as_the_engine_cannot_serve_it(tmp_path):
    folder = saved(tmp_path, "mistral", {})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": 64}))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        load_served_model(folder, torch.float32)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        check_decoder(load_model(folder, torch.float32))
