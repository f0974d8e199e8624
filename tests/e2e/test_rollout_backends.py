"""The rollout backend interface: the embedded and external backends behind ``make_backend``,
clients answering in the domain type ``Generation``, and clear errors at launch."""

from __future__ import annotations

import asyncio
import re

import pytest

from areal_core.experiment import ExperimentConfig
from areal_core.net import free_port
from areal_core.rollout.backend import Generation, Sampling
from areal_core.rollout.backends import make_backend
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.backends.embedded.launcher import EmbeddedBackend
from areal_core.rollout.backends.external import ExternalBackend
from areal_core.rollout.backends.sglang import SGLangBackend
from areal_core.rollout.client import RolloutServerError
from tests.e2e.test_rollout_server import hf_greedy, tiny_qwen2


def _rollout(**kw):
    return ExperimentConfig.model_validate({"rollout": kw}).rollout


def _make(rollout, log_dir, seed=0, device="auto"):
    return make_backend(
        rollout, engine=rollout.engine_config(seed=seed, dtype="float32", device=device), log_dir=log_dir
    )


def test_make_backend_picks_the_configured_one(tmp_path):
    assert isinstance(_make(_rollout(), tmp_path), EmbeddedBackend)
    ext = _make(
        _rollout(backend={"kind": "external", "urls": ["http://127.0.0.1:1"], "allow_unauthenticated": True}), tmp_path
    )
    assert isinstance(ext, ExternalBackend) and not ext.restartable
    sg = _make(_rollout(backend={"kind": "sglang", "tp_size": 2}), tmp_path)
    assert isinstance(sg, SGLangBackend) and sg.cfg.tp_size == 2 and sg.restartable
    assert _rollout(backend="embedded").backend.kind == "embedded"  # the shorthand


@pytest.mark.parametrize(
    "rollout, words",
    [
        ({"backend": "external"}, "urls"),
        ({"backend": {"kind": "external", "urls": []}}, "urls"),
        ({"backend": {"kind": "vlm"}}, "kind"),
        ({"backend": {"kind": "sglang", "tp_size": 0}}, "tp_size"),
        ({"backend": "external", "urls": ["http://x"]}, "backend: {kind: external, urls: [...]}"),
        ({"backend": {"kind": "external", "urls": ["http://x"]}}, "have no API key: set rollout.backend.api_key_file"),
        ({"backend": {"kind": "sglang", "urls": ["http://x"]}}, "have no API key"),
        ({"backend": {"kind": "external", "urls": ["http://x"], "api_key_file": "k", "api_key_env": "K"}}, "not both"),
        (
            {"backend": {"kind": "sglang", "allow_unauthenticated": True}},
            "servers the run starts get the run's own key",
        ),
    ],
)
def test_bad_backend_config_is_an_error_naming_the_key(rollout, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ExperimentConfig.model_validate({"rollout": rollout})


def test_generation_needs_one_logprob_and_version_per_token():
    Generation([1, 2], [-0.1, -0.2], [0, 0], "length")
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs, 2 versions"):
        Generation([1, 2], [-0.1], [0, 0], "stop")


def test_unreachable_external_server_fails_at_launch_naming_it(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with (
        pytest.raises(RolloutServerError, match=f"{url}.*do not answer GET /health"),
        ExternalBackend([url]).launch(str(tmp_path), 0),
    ):
        pass


async def _model_info(url):
    client = EmbeddedClient(url, 30.0)
    try:
        return await client.model_info()
    finally:
        await client.aclose()


def test_engine_config_reaches_the_server_whole_and_bad_json_is_named():
    from areal_core.rollout.backends.embedded.server import parse_args

    cfg = _rollout(max_running=7, weight_update="drain", torch_threads=2).engine_config(seed=9, dtype="bfloat16")
    args = parse_args(["--model-path", "m", "--port", "1", "--engine-config", cfg.model_dump_json()])
    assert args.engine_config == cfg and cfg.seed == 9 and cfg.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--port", "1", "--engine-config", '{"max_runing": 7}'])


def test_embedded_servers_behind_both_backends(tmp_path):
    """Embedded servers started by the embedded backend; the external backend, pointed at them,
    makes them load the run's weights as the given version; clients answer in Generation."""
    v0, v1 = tiny_qwen2(11), tiny_qwen2(12)
    v0.save_pretrained(tmp_path / "v0")
    v1.save_pretrained(tmp_path / "v1")
    embedded = _make(_rollout(n_servers=1, max_running=8, weight_update="keep_kv"), tmp_path, seed=3)
    prompt, greedy = [5, 6, 7, 8], Sampling(max_new_tokens=12, temperature=0.0)

    async def generate(client):
        try:
            return await client.generate(prompt, greedy, rid="g"), await client.info()
        finally:
            await client.aclose()

    with embedded.launch(str(tmp_path / "v0"), 0) as urls:
        gen, info = asyncio.run(generate(embedded.client(urls[0], 60.0)))
        assert isinstance(gen, Generation) and gen.output_ids == hf_greedy(v0, prompt, 12)
        assert set(gen.versions) == {0} and info.weight_version == 0 and not info.paused
        full = asyncio.run(_model_info(urls[0]))  # the engine got the run's settings whole
        assert (full.max_running, full.weight_update) == (8, "keep_kv")

        external = ExternalBackend(urls)
        with external.launch(str(tmp_path / "v1"), 7) as same:
            assert same == urls
            gen, info = asyncio.run(generate(external.client(urls[0], 60.0)))
        assert gen.output_ids == hf_greedy(v1, prompt, 12) and set(gen.versions) == {7}
        assert info.weight_version == 7
        with pytest.raises(RuntimeError, match="cannot be restarted"):
            external.restart(0, str(tmp_path / "v0"), 0)
    with pytest.raises(RuntimeError, match="outside launch"):
        embedded.restart(0, str(tmp_path / "v0"), 0)


def test_device_auto_is_the_cpu_here_and_cuda_without_a_gpu_fails_at_start(tmp_path):
    import torch

    from areal_core.device import resolve_device

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this checks the CPU-only machine's errors")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match=r"device: cuda was asked for.*cannot use CUDA here"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device: cuda"):  # the embedded backend checks before starting servers
        _make(_rollout(), tmp_path, device="cuda")
    assert ExperimentConfig.model_validate({"model": {"device": "cuda"}}).model.device == "cuda"
    with pytest.raises(ValueError, match="device"):
        ExperimentConfig.model_validate({"model": {"device": "tpu"}})


def test_sglang_backend_refuses_the_tensor_transport_and_maps_the_update_mode(tmp_path):
    with pytest.raises(ValueError, match=r"'tensor' is not supported by rollout.backend kind 'sglang'"):
        _rollout(backend={"kind": "sglang"}, weight_transport={"kind": "tensor"})
    assert _rollout(backend={"kind": "sglang"}).transport().kind == "distributed"  # the default off the host
    for mode, pause in (("keep_kv", "in_place"), ("reprefill", "retract"), ("drain", None)):
        backend = _make(_rollout(backend={"kind": "sglang"}, weight_update=mode), tmp_path)
        assert backend.client("http://127.0.0.1:1", 5.0).pause_mode == pause
