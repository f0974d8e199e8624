"""The rollout server as a real process on 127.0.0.1, driven through the launcher and the client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends import default_client
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.backends.embedded.engine import RolloutEngine
from areal_core.rollout.backends.embedded.launcher import EmbeddedServers, server_seed, start_server
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.pool import RolloutPool

VOCAB = 64


def tiny_qwen2(seed: int) -> torch.nn.Module:
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        eos_token_id=3,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(3) + 1] if 3 in out else out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-models")
    out = {}
    for name, seed in (("v0", 11), ("v1", 12)):
        m = tiny_qwen2(seed)
        m.save_pretrained(root / name)
        out[name] = (str(root / name), m)
    return out


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("rollout-logs") / "server.log")
    with start_server(models["v0"][0], max_running=16, startup_timeout_s=60, log_path=log) as s:
        yield s
    assert not s.alive()


def run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn):
    client = EmbeddedClient(url, timeout_s=60)
    try:
        return await fn(client)
    finally:
        await client.aclose()


def test_generate_matches_hf_greedy(server, models):
    prompt = [5, 6, 7, 8]
    resp = run(
        _with_client(
            server.url, lambda c: c.generate(prompt, Sampling(temperature=0.0, max_new_tokens=20), rid="greedy-1")
        )
    )
    assert resp.output_ids == hf_greedy(models["v0"][1], prompt, 20)
    assert len(resp.logprobs) == len(resp.output_ids) and resp.finish_reason == "length"
    assert set(resp.versions) == {0}


def test_batched_generate_answers_each_prompt_in_order(server, models):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    resps = run(_with_client(server.url, lambda c: c.generate_batch(prompts, [greedy] * 3, rids=["a", "b", "c"])))
    for p, r in zip(prompts, resps):
        assert r.output_ids == hf_greedy(models["v0"][1], p, 12)  # each its own answer, not a neighbour's

    async def bad(c: EmbeddedClient):
        async with c._http().post(c.url + "/generate", json={"input_ids": [[5, 6], [7]], "rid": ["only-one"]}) as r:
            return r.status, (await r.json())["message"]

    status, message = run(_with_client(server.url, bad))
    assert status == 400 and "rid has 1 ids for 2 prompts" in message


def test_sampling_seed_per_prompt_in_a_batch(server):
    """sampling_params.sampling_seed (SGLang's name): the same seed gives the same answer, alone or in a
    batch whose prompts each have their own sampling params; another seed gives another answer."""
    prompt = [5, 6, 7, 8]

    def sp(seed):
        return Sampling(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=seed)

    async def go(c: EmbeddedClient):
        batch = await c.generate_batch([prompt] * 3, [sp(1), sp(1), sp(2)], rids=["a", "b", "c"])
        return batch, await c.generate(prompt, sp(1)), await c.generate(prompt, sp(2))

    batch, one, two = run(_with_client(server.url, go))
    assert batch[0].output_ids == batch[1].output_ids == one.output_ids
    assert batch[2].output_ids == two.output_ids != one.output_ids


@pytest.mark.slow
def test_embedded_servers_sample_with_their_own_seeds(models, tmp_path):
    """Two servers of one run (EmbeddedServers, run seed 5) answer the same request differently at
    temperature 1; server k answers as an engine seeded server_seed(5, k) does (reproducible)."""
    path = models["v0"][0]
    sampling = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}

    async def ask(urls):
        clients = [EmbeddedClient(u, timeout_s=60) for u in urls]
        try:
            return [(await c.generate([5, 6, 7, 8], Sampling(**sampling))).output_ids for c in clients]
        finally:
            for c in clients:
                await c.aclose()

    with EmbeddedServers(
        path, 2, seed=5, startup_timeout_s=60, log_paths=[str(tmp_path / f"s{k}.log") for k in range(2)]
    ) as servers:
        got = run(ask(servers.urls))
    assert got[0] != got[1]
    for k in range(2):
        engine = RolloutEngine.from_pretrained(path, seed=server_seed(5, k), start=False)
        fut = engine.submit([5, 6, 7, 8], sampling)
        while engine.step():
            pass
        assert fut.result().output_ids == got[k]


def test_servers_report_their_kv_budget_in_positions_and_the_run_takes_the_smallest(models, tmp_path):
    from areal_core.rollout.backends.embedded.engine import kv_bytes_per_token
    from areal_core.rollout.config import EngineConfig, KVBudget
    from areal_core.run.budget import servers_kv_budget

    path = models["v0"][0]
    per_token = kv_bytes_per_token(RolloutEngine.from_pretrained(path, start=False).kv)
    budgets = (70, 50)
    started = [
        start_server(
            path,
            engine=EngineConfig(kv_budget=KVBudget(bytes=n * per_token + 3)),
            startup_timeout_s=60,
            log_path=str(tmp_path / f"s{n}.log"),
        )
        for n in budgets
    ]
    try:
        urls = [s.url for s in started]

        async def reported():
            clients = [EmbeddedClient(u, timeout_s=60) for u in urls]
            try:
                return [(await c.info()).kv_budget_tokens for c in clients]
            finally:
                for c in clients:
                    await c.aclose()

        assert run(reported()) == list(budgets)
        assert servers_kv_budget(urls, lambda u: EmbeddedClient(u, timeout_s=60)) == 50
    finally:
        for s in started:
            s.stop()


def test_32_concurrent_requests(server):
    async def go(c: EmbeddedClient):
        before = (await c.model_info()).generated_tokens
        reqs = [
            c.generate([i % VOCAB, 9, 10], Sampling(max_new_tokens=16, ignore_eos=True, seed=i), rid=f"r{i}")
            for i in range(32)
        ]
        resps = await asyncio.gather(*reqs)
        return before, resps, await c.model_info()

    before, resps, info = run(_with_client(server.url, go))
    assert all(len(r.output_ids) == 16 and r.finish_reason == "length" for r in resps)
    assert info.generated_tokens - before == 32 * 16
    assert info.running == 0 and info.waiting == 0


def test_the_server_says_what_it_computes_with(server):
    """/model_info names the server's CPU kind and kernels, MKL's reproducibility mode among them
    (areal_core sets it in every process it starts or runs in)."""
    info = run(_with_client(server.url, lambda c: c.model_info()))
    assert info.numerics is not None
    assert info.numerics["mkl_mode"] in (None, "AUTO,STRICT")
    assert info.numerics["torch"] == torch.__version__ and info.numerics["aten_capability"]


def test_pool_spreads_requests_and_broadcasts(server):
    async def go():
        pool = RolloutPool([server.url, server.url + "/"], default_client, timeout_s=60)
        try:
            resps = await asyncio.gather(*(pool.generate([1, 2], Sampling(max_new_tokens=4)) for _ in range(8)))
            await pool.pause()
            paused = [i.paused for i in await pool.model_infos()]
            await pool.resume()
            return resps, pool.sent, pool.in_flight, paused, await pool.health()
        finally:
            await pool.aclose()

    resps, sent, in_flight, paused, health = run(go())
    assert len(resps) == 8 and sent == [4, 4] and in_flight == [0, 0]
    assert paused == [True, True] and health == [True, True]


def test_pause_and_continue(server):
    async def go(c: EmbeddedClient):
        await c.pause()
        task = asyncio.create_task(c.generate([4, 5], Sampling(max_new_tokens=8)))
        await asyncio.sleep(0.5)
        info = await c.model_info()
        assert not task.done()
        assert info.paused and info.running + info.waiting == 1
        await c.resume()
        resp = await asyncio.wait_for(task, 30)
        return resp, await c.model_info()

    resp, info = run(_with_client(server.url, go))
    assert len(resp.output_ids) >= 1 and not info.paused


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        ("/generate", b"{not json", 400, "JSON"),
        ("/generate", b'{"input_ids": "abc"}', 400, "input_ids"),
        ("/generate", b'{"input_ids": []}', 400, "input_ids"),
        ("/generate", b'{"input_ids": [1], "bogus": 1}', 400, "bogus"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 10000000000}}', 400, "max_new_tokens"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', 400, "temperature"),
        ("/generate", b'{"input_ids": [99999999999999999999]}', 400, "vocabulary"),
        ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 511}}', 400, "context"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"sampling_seed": -5}}', 400, "sampling_seed"),
        (
            "/generate",
            b'{"input_ids": [[1], [2]], "sampling_params": [{"sampling_seed": 1}]}',
            400,
            "sampling_params has 1 entries for 2 prompts",
        ),
        ("/update_weights_from_disk", b'{"model_path": "/no/such/folder", "weight_version": 1}', 400, "does not exist"),
        ("/update_weights_from_disk", b'{"model_path": "x", "weight_version": -1}', 400, "weight_version"),
        ("/pause_generation", b'{"mode": "abort"}', 400, "mode"),
    ],
)
def test_bad_requests_get_4xx_and_server_stays_up(server, path, body, status, words):
    r = httpx.post(
        server.url + path, content=body, headers={"content-type": "application/json", **_key(server)}, trust_env=False
    )
    assert r.status_code == status, r.text
    assert words in r.json()["message"]
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200


def test_oversized_body_and_unknown_path(server):
    big = b'{"input_ids": [' + b"1," * (5 << 20) + b"1]}"
    r = httpx.post(server.url + "/generate", content=big, headers=_key(server), trust_env=False)
    assert r.status_code == 413 and "limit" in r.json()["message"]
    r = httpx.get(server.url + "/no/such/endpoint", headers=_key(server), trust_env=False)
    assert r.status_code == 404 and r.json()["message"]


def _key(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


WEIGHT_ENDPOINTS = [
    ("POST", "/update_weights_from_tensor", {"shm_name": "x", "tensors": [], "weight_version": 1}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": 1}),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"},
    ),
    (
        "POST",
        "/update_weights_from_distributed",
        {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "weight_version": 1},
    ),
    ("POST", "/get_weights_by_name", {"name": "lm_head.weight"}),
]
OTHER_ENDPOINTS = [
    ("POST", "/generate", {"input_ids": [1]}),
    ("POST", "/pause_generation", {}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_requests", None),
    ("GET", "/no/such/endpoint", None),
]


@pytest.mark.parametrize("method, path, body", WEIGHT_ENDPOINTS + OTHER_ENDPOINTS)
@pytest.mark.parametrize("auth", ["none", "wrong", "not bearer"])
def test_every_endpoint_but_health_needs_the_key(server, method, path, body, auth):
    """A request without the server's key, with a wrong one, or not as a bearer token: 401 with one line
    of JSON, before the body is even read; the weights and the version stay as they were."""
    headers = {
        "none": {},
        "wrong": {"Authorization": "Bearer " + "x" * len(server.api_key)},
        "not bearer": {"Authorization": server.api_key},
    }[auth]
    before = httpx.get(server.url + "/get_model_info", headers=_key(server), trust_env=False).json()
    r = httpx.request(method, server.url + path, json=body, headers=headers, trust_env=False)
    assert r.status_code == 401, (path, r.status_code, r.text)
    assert "\n" not in r.text and "API key" in r.json()["message"] and r.json()["error"]["type"] == "unauthorized"
    after = httpx.get(server.url + "/get_model_info", headers=_key(server), trust_env=False).json()
    assert after["weight_version"] == before["weight_version"] and not after["paused"]
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200  # open, for probes


def test_the_key_travels_in_the_environment_not_the_command_line(server):
    import psutil

    argv = " ".join(psutil.Process(server.pid).cmdline())
    assert server.api_key and server.api_key not in argv
    with open(f"/proc/{server.pid}/environ", "rb") as f:  # (its own user, and root, can read this)
        assert f"AREAL_ROLLOUT_API_KEY={server.api_key}".encode() in f.read().split(b"\0")


def test_a_server_without_a_key_does_not_start_unless_told(models, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AREAL_ROLLOUT_API_KEY"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_core.rollout.backends.embedded.server",
            "--model-path",
            models["v0"][0],
            "--port",
            "9",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "no API key: set AREAL_ROLLOUT_API_KEY" in r.stderr


def test_client_raises_with_the_servers_message(server):
    async def go(c: EmbeddedClient):
        with pytest.raises(RolloutServerError, match="vocabulary") as e:
            await c.generate([VOCAB + 1], Sampling(max_new_tokens=2))
        assert e.value.status == 400
        with pytest.raises(RolloutServerError, match="does not exist"):
            await c.update_weights_from_disk("/no/such/folder", 5)
        assert (await c.model_info()).weight_version == 0
        dead = EmbeddedClient("http://127.0.0.1:9", timeout_s=2)
        assert not await dead.health()
        with pytest.raises(RolloutServerError, match="unreachable"):
            await dead.model_info()
        await dead.aclose()

    run(_with_client(server.url, go))


def test_update_weights_mid_generation(server, models):
    path0, _ = models["v0"]
    path1, m1 = models["v1"]

    async def go(c: EmbeddedClient):
        long = [
            asyncio.create_task(c.generate([i + 4, 7], Sampling(max_new_tokens=400, ignore_eos=True))) for i in range(8)
        ]
        while (await c.model_info()).running < 8:  # noqa: ASYNC110 - polls the server over HTTP
            await asyncio.sleep(0.01)
        await c.update_weights_from_disk(path1, 1)
        info = await c.model_info()
        resps = await asyncio.gather(*long)
        greedy = await c.generate([5, 6, 7, 8], Sampling(temperature=0.0, max_new_tokens=20))
        await c.update_weights_from_disk(path0, 2)  # leave the shared server as the other tests expect it
        return info, resps, greedy

    info, resps, greedy = run(_with_client(server.url, go))
    assert info.weight_version == 1 and info.model_path == path1
    for r in resps:
        assert r.versions == sorted(r.versions) and r.versions[-1] == 1
    assert any(r.versions[0] == 0 for r in resps)
    assert greedy.output_ids == hf_greedy(m1, [5, 6, 7, 8], 20)
    assert set(greedy.versions) == {1}


def test_non_interruptible_server_and_stop(models, tmp_path):
    s = start_server(
        models["v0"][0],
        weight_update="drain",
        weight_version=7,
        startup_timeout_s=60,
        log_path=str(tmp_path / "server.log"),
    )
    try:
        info = run(_with_client(s.url, lambda c: c.model_info()))
        assert info.weight_update == "drain" and info.weight_version == 7
    finally:
        s.stop()
    assert not s.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(s.pid, 0)
    s.stop()  # idempotent


def test_start_failure_reports_the_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code") as e:
        start_server(str(tmp_path / "no-model"), startup_timeout_s=60, log_path=str(tmp_path / "server.log"))
    assert "no-model" in str(e.value)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie is gone for our purpose
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_server_exits_when_its_parent_dies(models, tmp_path):
    code = (
        "import time; from areal_core.rollout.backends.embedded.launcher import start_server; "
        f"s = start_server({models['v0'][0]!r}, log_path={str(tmp_path / 'server.log')!r}, startup_timeout_s=60); "
        "print(s.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        parent.kill()  # no atexit, no stop(): the server must notice by itself
        parent.wait()
        deadline = time.monotonic() + 20
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if pid is not None and not _gone(pid):
            os.killpg(pid, signal.SIGKILL)


def test_partial_outputs_of_running_requests(server):
    """/get_requests shows what an unfinished request has so far; it is a prefix of the answer,
    and continuing from it (prompt + prefix, fewer tokens) is how a resumed run goes on."""

    async def go(c: EmbeddedClient):
        task = asyncio.ensure_future(
            c.generate([5, 6, 7], Sampling(max_new_tokens=300, ignore_eos=True, seed=3), rid="long-1")
        )
        seen = None
        for _ in range(500):
            snap = await c.requests()
            mine = [p for p in snap.requests if p.rid == "long-1"]
            if mine and len(mine[0].output_ids) >= 5:
                seen = mine[0]
                break
            await asyncio.sleep(0.01)
        resp = await task
        cont = await c.generate(
            [5, 6, 7] + seen.output_ids,
            Sampling(max_new_tokens=300 - len(seen.output_ids), ignore_eos=True),
            rid="long-1",
        )
        return seen, resp, cont, await c.requests()

    seen, resp, cont, after = run(_with_client(server.url, go))
    assert seen is not None and 5 <= len(seen.output_ids) < 300
    k = len(seen.output_ids)
    assert resp.output_ids[:k] == seen.output_ids
    assert resp.logprobs[:k] == seen.output_token_logprobs
    assert resp.versions[:k] == seen.output_token_versions
    assert len(seen.output_ids) + len(cont.output_ids) == 300
    assert after.requests == []
