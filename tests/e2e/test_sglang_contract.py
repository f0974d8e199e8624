"""The SGLang backend against a stand-in for SGLang's HTTP contract (tests/sglang_standin.py).

None of this runs SGLang (it needs CUDA): it checks that the client sends SGLang 0.5.x's field
names and reads its answers, including a response body built from SGLang's source.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from pathlib import Path

import httpx
import pytest

from areal_core.net import free_port
from areal_core.rollout.backend import Generation, Sampling, versions_from_spans
from areal_core.rollout.backends.sglang import (
    SGLangBackend,
    SGLangClient,
    SGLangConfig,
    parse_generate_response,
    sglang_launch_command,
    wire_rid,
)
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.weight_layout import TensorSpec
from tests.sglang_standin import (
    SGLANG_ABORTED_RESPONSE_FIXTURE,
    SGLANG_GENERATE_RESPONSE_FIXTURE,
    SGLangContractStandIn,
    token_logprob,
)


@pytest.fixture
def standin():
    s = SGLangContractStandIn(weight_version="0", step_s=0.002)
    s.start()
    yield s
    s.stop()


def run(coro_fn, url: str, **kw):
    """``coro_fn(client)`` with a fresh client, closed afterwards."""

    async def go():
        client = SGLangClient(url, **kw)
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def expected(prompt_last: int, n: int, version: int = 0) -> tuple[list[int], list[float]]:
    ids = [(prompt_last + k) % 1000 for k in range(1, n + 1)]
    return ids, [token_logprob(t, str(version)) for t in ids]


async def wait_tokens(standin: SGLangContractStandIn, rid: str, n: int) -> int:
    """Until request ``rid`` has at least ``n`` output tokens on the stand-in; their number."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = standin.call(lambda: len(standin.active[rid].out) if rid in standin.active else -1)
        if got >= n:
            return got
        await asyncio.sleep(0.002)
    raise TimeoutError(f"request {rid} did not reach {n} tokens")


# -- generate ---------------------------------------------------------------------------------


def test_generate_single(standin):
    g = run(lambda c: c.generate([3, 4, 5], Sampling(max_new_tokens=6), "r1"), standin.url)
    ids, lps = expected(5, 6)
    assert isinstance(g, Generation)
    assert (g.output_ids, g.versions, g.finish_reason) == (ids, [0] * 6, "length")
    assert g.logprobs == pytest.approx(lps)
    path, body = standin.log[-1]
    assert path == "/generate"
    assert body == {
        "input_ids": [3, 4, 5],
        "rid": "2:r1",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
    }


def test_generate_sampling_fields_and_stop(standin):
    s = Sampling(max_new_tokens=50, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(12,), seed=1234)
    g = run(lambda c: c.generate([9], s, "r-stop"), standin.url)
    assert g.output_ids == [10, 11, 12] and g.finish_reason == "stop"
    assert standin.log[-1][1]["sampling_params"] == {
        "max_new_tokens": 50,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop_token_ids": [12],
        "sampling_seed": 1234,
    }


def test_generate_batch(standin):
    prompts = [[1, 2], [500], [998, 999]]
    sampling = [Sampling(max_new_tokens=3), Sampling(max_new_tokens=5, seed=7), Sampling(max_new_tokens=2)]
    gens = run(lambda c: c.generate_batch(prompts, sampling, ["a", "b", "c"]), standin.url)
    for p, s, g in zip(prompts, sampling, gens):
        ids, lps = expected(p[-1], s.max_new_tokens)
        assert g.output_ids == ids and g.logprobs == pytest.approx(lps) and g.finish_reason == "length"
    assert gens[2].output_ids == [0, 1]  # wraps around the vocabulary
    body = standin.log[-1][1]
    assert body["input_ids"] == prompts and body["rid"] == ["1:a", "1:b", "1:c"]
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [3, 5, 2]
    assert body["sampling_params"][1]["sampling_seed"] == 7


# -- versions across a weight update, pause modes, abort --------------------------------------


def test_versions_across_update_mid_request_keep_kv(standin):
    async def go(c: SGLangClient):
        task = asyncio.create_task(c.generate([100], Sampling(max_new_tokens=40), "mid"))
        await wait_tokens(standin, wire_rid("mid"), 5)
        await c.pause()  # in_place: held with its KV
        k = standin.call(lambda: len(standin.active[wire_rid("mid")].out))
        await c.update_weights_from_disk("/ckpt/step1", 1)
        info = await c.info()
        await c.resume()
        return k, await task, info

    k, g, info = run(go, standin.url, pause_mode="in_place")
    assert 5 <= k < 40
    assert info.weight_version == 1 and info.paused and info.running == 1
    assert g.versions == [0] * k + [1] * (40 - k) and g.finish_reason == "length"
    ids, _ = expected(100, 40)
    assert g.output_ids == ids
    assert g.logprobs == pytest.approx([token_logprob(t, str(v)) for t, v in zip(ids, g.versions)])
    update = [b for p, b in standin.log if p == "/update_weights_from_disk"][-1]
    assert update == {
        "model_path": "/ckpt/step1",
        "weight_version": "1",
        "abort_all_requests": False,
        "flush_cache": False,
    }  # in_place: SGLang cannot flush while requests are held
    assert ("/pause_generation", {"mode": "in_place"}) in standin.log


def test_pause_abort_then_continue_from_partial(standin):
    async def go(c: SGLangClient):
        task = asyncio.create_task(c.generate([20], Sampling(max_new_tokens=30), "p1"))
        await wait_tokens(standin, wire_rid("p1"), 4)
        await c.pause()
        part = await task  # returns at once, cut short
        await c.update_weights_from_disk("/ckpt/step2", 2)
        await c.resume()
        rest = await c.generate([20] + part.output_ids, Sampling(max_new_tokens=30 - len(part.output_ids)), "p1-2")
        return part, rest

    part, rest = run(go, standin.url, pause_mode="abort")
    assert part.finish_reason == "abort" and 4 <= len(part.output_ids) < 30
    assert part.versions == [0] * len(part.output_ids)
    ids, _ = expected(20, 30)
    assert part.output_ids + rest.output_ids == ids
    assert rest.versions == [2] * len(rest.output_ids) and rest.finish_reason == "length"


def test_pause_retract_holds_new_requests_until_continue(standin):
    async def go(c: SGLangClient):
        await c.pause()
        task = asyncio.create_task(c.generate([1], Sampling(max_new_tokens=3), "late"))
        await asyncio.sleep(0.05)
        held = not task.done()
        await c.resume()
        return held, await task

    held, g = run(go, standin.url, pause_mode="retract")
    assert held and g.output_ids == [2, 3, 4] and g.finish_reason == "length"


def test_abort_request(standin):
    async def go(c: SGLangClient):
        task = asyncio.create_task(c.generate([7], Sampling(max_new_tokens=500), "victim"))
        other = asyncio.create_task(c.generate([7], Sampling(max_new_tokens=20), "bystander"))
        await wait_tokens(standin, wire_rid("victim"), 3)
        await c.abort_request("victim")
        return await task, await other

    g, other = run(go, standin.url)
    assert g.finish_reason == "abort" and 3 <= len(g.output_ids) < 500
    assert g.output_ids == expected(7, len(g.output_ids))[0]
    assert other.finish_reason == "length" and len(other.output_ids) == 20
    assert ("/abort_request", {"rid": "6:victim"}) in standin.log


def test_abort_of_one_answer_leaves_its_siblings_whose_ids_it_prefixes(standin):
    """SGLang aborts every request whose rid starts with the one given: answer s1 of a group is a prefix
    of answers s10..s15, yet aborting it must stop it alone."""

    async def go(c: SGLangClient):
        rids = ["e0-p7-s1", *(f"e0-p7-s{k}" for k in range(10, 16))]
        tasks = {
            r: asyncio.create_task(c.generate([7], Sampling(max_new_tokens=40 if r != rids[0] else 500), r))
            for r in rids
        }
        await wait_tokens(standin, wire_rid(rids[0]), 3)
        await c.abort_request(rids[0])
        return {r: await t for r, t in tasks.items()}

    gens = run(go, standin.url)
    assert gens["e0-p7-s1"].finish_reason == "abort"
    survivors = {r: g.finish_reason for r, g in gens.items() if r != "e0-p7-s1"}
    assert survivors == {f"e0-p7-s{k}": "length" for k in range(10, 16)}, survivors
    sent = [b["rid"] for p, b in standin.log if p == "/generate"]
    assert all(not a.startswith(b) for a in sent for b in sent if a != b), sent  # no id prefixes another


def test_the_client_sends_the_servers_key_and_a_keyless_request_gets_401():
    s = SGLangContractStandIn(weight_version="2", api_key="k-123")
    s.start()
    try:
        assert run(lambda c: c.info(), s.url, api_key="k-123").weight_version == 2
        with pytest.raises(RolloutServerError, match="HTTP 401"):
            run(lambda c: c.generate([1], Sampling(max_new_tokens=1), "x"), s.url, api_key="wrong")
        assert httpx.post(s.url + "/update_weights_from_disk", json={"model_path": "/x"}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_update_weights_from_disk_and_info(standin):
    async def go(c: SGLangClient):
        before = await c.info()
        await c.update_weights_from_disk("/ckpt/step5", 5)
        after = await c.info()
        g = await c.generate([1], Sampling(max_new_tokens=2), "after")
        with pytest.raises(RolloutServerError) as e:
            await c.update_weights_from_disk("/missing/ckpt", 6)
        return before, after, g, e.value, await c.health()

    before, after, g, err, healthy = run(go, standin.url)
    assert (before.weight_version, before.running, before.waiting, before.paused) == (0, 0, 0, False)
    assert after.weight_version == 5 and g.versions == [5, 5]
    assert err.status == 400 and not err.server_down and "/missing/ckpt" in str(err)
    assert healthy


def test_distributed_update_fields(standin):
    async def go(c: SGLangClient):
        await c.init_weights_update_group("10.0.0.1", 29500, 1, 3, "areal")
        specs = [TensorSpec("w1", "bfloat16", (4, 8), 0), TensorSpec("w2", "float32", (8,), 64)]
        await c.update_weights_from_distributed(specs, "areal", 3)
        return await c.info()

    assert run(go, standin.url).weight_version == 3
    # not paused by the caller: the update is wrapped in pause (retract) and continue
    paths = [p for p, _ in standin.log]
    i = paths.index("/update_weights_from_distributed")
    assert paths[i - 1] == "/pause_generation" and paths[i + 1] == "/continue_generation"
    posts = dict(standin.log)
    assert posts["/init_weights_update_group"] == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "areal",
        "backend": "nccl",
    }
    assert posts["/update_weights_from_distributed"]["shapes"] == [[4, 8], [8]]
    assert posts["/update_weights_from_distributed"]["weight_version"] == "3"


# -- errors -----------------------------------------------------------------------------------


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutServerError) as e:
        run(lambda c: c.generate([1], Sampling(max_new_tokens=1), "x"), url, retries=0)
    assert e.value.server_down and e.value.status is None and url in str(e.value)
    assert run(lambda c: c.health(), url) is False


def test_non_2xx_answer(standin):
    standin.fail_next = (503, {"object": "error", "message": "engine overloaded", "type": "503", "code": 503})
    with pytest.raises(RolloutServerError) as e:
        run(lambda c: c.generate([1], Sampling(max_new_tokens=1), "x"), standin.url)
    assert e.value.status == 503 and e.value.server_down and "engine overloaded" in str(e.value)
    assert standin.url in str(e.value)


def test_malformed_response_names_the_field(standin):
    def drop_logprobs(body):
        del body["meta_info"]["output_token_logprobs"]
        return body

    standin.mutate_next = drop_logprobs
    with pytest.raises(RolloutServerError, match=r"meta_info\.output_token_logprobs") as e:
        run(lambda c: c.generate([1], Sampling(max_new_tokens=3), "x"), standin.url)
    assert not e.value.server_down and standin.url in str(e.value)
    standin.mutate_next = lambda body: {
        **body,
        "meta_info": {k: v for k, v in body["meta_info"].items() if k != "finish_reason"},
    }
    with pytest.raises(RolloutServerError, match=r"meta_info\.finish_reason"):
        run(lambda c: c.generate([1], Sampling(max_new_tokens=3), "x"), standin.url)


def test_standin_refuses_unknown_fields(standin):
    async def go(c: SGLangClient):
        return await c._json("POST", "/generate", {"input_ids": [1], "rid": "x", "sampling_params": {"seed": 1}})

    with pytest.raises(RolloutServerError, match="unknown field") as e:
        run(go, standin.url)
    assert e.value.status == 400


# -- parsing SGLang-shaped bodies (no server) -------------------------------------------------


def test_parse_sglang_shaped_response():
    g = parse_generate_response(copy.deepcopy(SGLANG_GENERATE_RESPONSE_FIXTURE))
    assert g.output_ids == [279, 4226, 374, 220, 19]
    assert g.logprobs == [-0.312, -1.07, -0.0042, -2.5, -0.61]
    assert g.versions == [3, 3, 4, 4, 4] and g.finish_reason == "length"
    with_text = copy.deepcopy(SGLANG_GENERATE_RESPONSE_FIXTURE)  # return_text_in_logprobs: text filled in
    for entry, text in zip(with_text["meta_info"]["output_token_logprobs"], [" the", " answer", " is", " ", "4"]):
        entry[2] = text
    assert parse_generate_response(with_text) == g
    aborted = parse_generate_response(copy.deepcopy(SGLANG_ABORTED_RESPONSE_FIXTURE))
    assert aborted.finish_reason == "abort" and aborted.output_ids == [279] and aborted.versions == [3]


def test_parse_without_spans_uses_weight_version():
    body = copy.deepcopy(SGLANG_GENERATE_RESPONSE_FIXTURE)
    del body["meta_info"]["weight_versions"]
    assert parse_generate_response(body).versions == [4] * 5


def test_parse_rejects_bad_bodies():
    def broken(mutate):
        body = copy.deepcopy(SGLANG_GENERATE_RESPONSE_FIXTURE)
        mutate(body)
        return body

    cases = [
        (lambda b: b.pop("output_ids"), "output_ids"),
        (lambda b: b.pop("meta_info"), "meta_info"),
        (lambda b: b["meta_info"].update(finish_reason={"type": "eos"}), "finish_reason"),
        (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "has 4 entries for 5"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(1, 7), r"output_token_logprobs\[1\]"),
        (lambda b: b["meta_info"]["weight_versions"][0].update(version="default"), "--weight-version"),
        (lambda b: b["meta_info"]["weight_versions"][1].update(end=4), "cover 4 tokens"),
    ]
    for mutate, match in cases:
        with pytest.raises(RolloutServerError, match=match):
            parse_generate_response(broken(mutate), "http://h:1")


def test_versions_from_spans_edge_cases():
    assert versions_from_spans([{"version": "1", "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 3}], 3) == [
        1,
        1,
        2,
    ]
    assert versions_from_spans([{"version": "0", "start": 0, "end": 0}], 0) == []  # no output tokens
    with pytest.raises(ValueError, match="does not continue"):  # gap
        versions_from_spans([{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 3, "end": 4}], 4)
    with pytest.raises(ValueError, match="does not continue"):  # overlap
        versions_from_spans([{"version": 1, "start": 0, "end": 3}, {"version": 2, "start": 2, "end": 4}], 4)
    with pytest.raises(ValueError, match="does not continue"):  # not from 0
        versions_from_spans([{"version": 1, "start": 1, "end": 3}], 3)
    with pytest.raises(ValueError, match="does not continue"):  # end before start
        versions_from_spans([{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 1}], 2)
    with pytest.raises(ValueError, match="cover 2 tokens, the output has 3"):  # wrong total
        versions_from_spans([{"version": 1, "start": 0, "end": 2}], 3)
    with pytest.raises(ValueError, match="integers"):
        versions_from_spans([{"version": "default", "start": 0, "end": 1}], 1)
    with pytest.raises(ValueError, match="integers"):
        versions_from_spans([{"version": 1, "start": 0}], 1)


# -- launcher ---------------------------------------------------------------------------------


def test_launch_command():
    cfg = SGLangConfig(
        tp_size=2,
        mem_fraction_static=0.7,
        host="0.0.0.0",
        python="/venvs/sglang/bin/python",
        extra_args=["--dtype", "bfloat16"],
    )
    assert sglang_launch_command(cfg, "/models/qwen", 31000, weight_version=4) == [
        "/venvs/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--weight-version",
        "4",
        "--dtype",
        "bfloat16",
    ]
    with pytest.raises(ValueError):
        SGLangConfig(tp_size=0)
    with pytest.raises(ValueError):
        SGLangConfig(mem_fraction_static=1.5)


def test_backend_configured_urls(standin):
    dead = f"http://127.0.0.1:{free_port()}"
    backend = SGLangBackend(SGLangConfig(urls=[standin.url, dead], connect_timeout_s=0.3, allow_unauthenticated=True))
    with pytest.raises(RolloutServerError) as e, backend.launch("/models/m", 0):
        pass
    assert e.value.server_down and f"{dead}/health" in str(e.value) and "unreachable" in str(e.value)
    backend = SGLangBackend(SGLangConfig(urls=[standin.url + "/"], allow_unauthenticated=True))
    with backend.launch("/models/m", 4) as urls:  # configured servers load the run's weights at launch
        assert urls == [standin.url] and not backend.restartable
        assert run(lambda c: c.info(), urls[0]).weight_version == 4
        assert [b for p, b in standin.log if p == "/update_weights_from_disk"][-1]["model_path"] == "/models/m"
        with pytest.raises(RuntimeError, match="cannot be restarted"):
            backend.restart(0, "/models/m", 4)
        assert isinstance(backend.client(urls[0], 30.0), SGLangClient)


def _listen_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports below the kernel's ephemeral range (32768 and up), so an
    outgoing connection of another process cannot take one between this check and the server's bind."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000 - n)
        try:
            for p in range(first, first + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32000")


def test_backend_starts_restarts_and_stops_servers(tmp_path):
    """The launcher's argv run by a fake ``sglang.launch_server`` that serves the stand-in."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A fake sglang package for this test only: not SGLang."""\n')
    (pkg / "launch_server.py").write_text("from sglang_standin import main\n\nmain()\n")
    tests_dir = str(Path(__file__).resolve().parents[1])  # tests/: sglang_standin.py
    port = _listen_ports(2)
    cfg = SGLangConfig(
        num_servers=2, port=port, port_stride=1, startup_timeout_s=120, env={"PYTHONPATH": f"{tmp_path}:{tests_dir}"}
    )
    backend = SGLangBackend(cfg, log_dir=str(tmp_path), api_key="the-run-key")
    with backend.launch("/models/m", 3) as urls:
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        pids = [backend.servers[u][1].pid for u in urls]
        info = run(lambda c: c.info(), urls[1])
        assert info.weight_version == 3
        # the key reached the servers in a file only its owner reads (--config), never in their argv
        import psutil

        argv = psutil.Process(pids[0]).cmdline()
        config = argv[argv.index("--config") + 1]
        assert "the-run-key" not in " ".join(argv) and oct(os.stat(config).st_mode & 0o777) == "0o600"
        assert httpx.post(urls[0] + "/pause_generation", json={}).status_code == 401
        assert httpx.get(urls[0] + "/health").status_code == 200
        backend.restart(0, "/models/m", 5)  # from a newer checkpoint, on the same port
        new = backend.servers[urls[0]][1]
        assert new.pid != pids[0] and new.alive()
        assert run(lambda c: c.generate([1], Sampling(max_new_tokens=2), "r"), urls[0]).versions == [5, 5]
        procs = [p for _, p in backend.servers.values()]
    assert not any(p.alive() for p in procs) and backend.servers == {}


def test_backend_reports_a_server_that_dies_at_start(tmp_path):
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import sys\nprint('no CUDA here', flush=True)\nsys.exit(3)\n")
    cfg = SGLangConfig(port=free_port(), startup_timeout_s=30, env={"PYTHONPATH": str(tmp_path)})
    with (
        pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*no CUDA here"),
        SGLangBackend(cfg, log_dir=str(tmp_path)).launch("/models/m", 0),
    ):
        pass


@pytest.mark.slow
def test_a_training_run_through_the_sglang_client(tmp_path, warm_cache, shared_rewards):
    """The whole loop with `rollout.backend: {kind: sglang, urls: [...]}` against the stand-in
    (not SGLang: its answers are counting sequences, not the policy's): generation through SGLang's
    fields, weights by the disk transport wrapped in pause/continue, every trajectory once."""
    from areal_core.experiment import load_config
    from areal_core.models import build_char_tokenizer
    from areal_core.run.setup import run_experiment

    s = SGLangContractStandIn(weight_version="0", step_s=0.0005, vocab=len(build_char_tokenizer()), api_key="its-key")
    s.start()
    try:
        os.environ["SGLANG_TEST_KEY"] = "its-key"  # the run reads the servers' key from the variable named
        cfg = load_config(
            Path(__file__).resolve().parents[1] / "data/e2e.yaml",
            {
                "rollout.backend": {"kind": "sglang", "urls": [s.url], "api_key_env": "SGLANG_TEST_KEY"},
                "rollout.weight_transport": {"kind": "disk"},
                "trainer.max_steps": 3,
                **shared_rewards,
            },
        )
        summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    finally:
        os.environ.pop("SGLANG_TEST_KEY", None)
        s.stop()
    assert summary["ledger_check"]["ok"] and summary["steps"] == 3
    assert summary["max_staleness_observed"] <= cfg.trainer.eta
    paths = [p for p, _ in s.log]
    assert paths.count("/update_weights_from_disk") >= 4  # the start (v0) and each of the 3 versions
    i = paths.index("/update_weights_from_disk", 1 + paths.index("/update_weights_from_disk"))
    assert paths[i - 1] == "/pause_generation" and paths[i + 1] == "/continue_generation"
