"""KV-cache-aware admission (rollout.kv_budget): the running requests' reserved KV positions never
exceed the budget, a request larger than the whole budget is refused by name and size, the queue
is FIFO (a large head request is never overtaken), weight updates and aborts keep working, and the
unbounded default is unchanged."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import yaml
from pydantic import ValidationError

from areal_core.rollout.backend import Generation, Sampling
from areal_core.rollout.backends.embedded.engine import RequestError, RolloutEngine
from areal_core.rollout.backends.embedded.server import create_app, parse_args
from areal_core.rollout.config import EngineConfig, KVBudget, RolloutConfig
from areal_core.rollout.pool import RolloutPool
from areal_core.rollout.weight_transport import named_weights
from tests.e2e.test_rollout_server import tiny_qwen2

# tiny_qwen2: 2 layers, 2 kv heads, head_dim 64 / 4 = 16, float32
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _sampling(max_new: int, **kw) -> dict:
    return {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True, **kw}


class Recorder:
    """Wraps the engine's admission: after every admission pass, the engine's accounted KV
    positions, the same figure computed from the requests' own lengths, the admitted rids in
    order, and whether a waiting head was held back although it fit."""

    def __init__(self, engine: RolloutEngine, reserve: dict[str, int]):
        self.engine, self.reserve = engine, reserve
        self.accounted: list[int] = []
        self.independent: list[int] = []
        self.held_cache: list[int] = []
        self.admitted: list[str] = []
        self.held_back_though_fitting = 0
        self._seen: set[str] = set()
        self._admit = engine._admit
        engine._admit = self

    def __call__(self) -> None:
        self._admit()
        e = self.engine
        running = [s.rid for s in e._running]
        self.admitted += [r for r in running if r not in self._seen]
        self._seen.update(running)
        self.accounted.append(e.kv_reserved_tokens)
        self.independent.append(sum(self.reserve[r] for r in running))
        self.held_cache.append(sum(s.cache_len for s in e._running))
        room = e.max_running > len(running) and not (e._drains and e._updates)
        if e._waiting and room and self.reserve[e._waiting[0].rid] <= e.kv_budget_tokens - self.independent[-1]:
            self.held_back_though_fitting += 1


def _burst(engine: RolloutEngine, n: int, seed: int, arrive_over: int = 30):
    """Submit ``n`` random requests, some at once and the rest over the first steps; step to the end."""
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [r.randrange(4, 64) for _ in range(r.randrange(1, 25))]
        jobs.append((f"r{i}", prompt, r.randrange(1, 40), r.randrange(arrive_over) if i >= n // 2 else 0))
    reserve = {rid: len(p) + m for rid, p, m, _ in jobs}
    rec = Recorder(engine, reserve)
    futs, step = {}, 0
    while True:
        for rid, p, m, at in jobs:
            if at == step:
                futs[rid] = engine.submit(p, _sampling(m), rid=rid)
        step += 1
        if not engine.step() and len(futs) == n:
            break
    return jobs, futs, rec


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_never_over_budget_under_a_random_burst(seed):
    budget = 150
    engine = RolloutEngine(tiny_qwen2(3), start=False, max_running=64, seed=seed, kv_budget=KVBudget(tokens=budget))
    jobs, futs, rec = _burst(engine, 40, seed)
    assert rec.accounted == rec.independent  # the engine's figure is the requests' own
    assert max(rec.accounted) <= budget
    assert max(rec.accounted) > budget * 0.75  # the budget was what bound admission
    assert max(rec.held_cache) <= budget  # positions actually in the cache
    assert rec.held_back_though_fitting == 0  # a head that fits is admitted at once
    for rid, _, m, _ in jobs:
        out = futs[rid].result(timeout=0)
        assert len(out.output_ids) == m and out.meta_info.finish_reason.type == "length"


def test_the_budget_can_be_given_in_bytes():
    engine = RolloutEngine(tiny_qwen2(3), start=False, kv_budget=KVBudget(bytes=100 * BYTES_PER_TOKEN + 7))
    assert engine.kv_bytes_per_token == BYTES_PER_TOKEN and engine.kv_budget_tokens == 100
    assert engine.info().kv_budget_tokens == 100  # what the server reports, in positions
    assert RolloutEngine(tiny_qwen2(3), start=False).info().kv_budget_tokens is None
    with pytest.raises(ValueError, match=f"holds no KV position of this model .{BYTES_PER_TOKEN} bytes per token"):
        RolloutEngine(tiny_qwen2(3), start=False, kv_budget=KVBudget(bytes=BYTES_PER_TOKEN - 1))


def test_a_burst_of_equal_requests_allocates_no_more_cache_than_the_budget():
    """Like RL's requests (one max_new_tokens, prompts of similar length): the cache grows to the
    rows admitted times their reservation, not the unbounded engine's head start and doublings."""
    budget = 8 * 40
    engine = RolloutEngine(tiny_qwen2(3), start=False, max_running=64, kv_budget=KVBudget(tokens=budget))
    futs = [engine.submit([5 + i % 50] * 10, _sampling(30)) for i in range(30)]
    peak = 0
    while engine.step():
        peak = max(peak, sum(t.nbytes for t in engine.kv.kv))
    assert all(len(f.result().output_ids) == 30 for f in futs)
    assert 0 < peak <= budget * BYTES_PER_TOKEN


def test_an_oversized_request_is_refused_by_size_and_the_others_complete():
    engine = RolloutEngine(tiny_qwen2(3), start=False, kv_budget=KVBudget(tokens=50))
    ok = [engine.submit([7] * 5, _sampling(20), rid=f"ok{i}") for i in range(4)]
    with pytest.raises(RequestError) as e:
        engine.submit([7] * 11, _sampling(40), rid="big")
    msg = str(e.value)
    assert "request big" in msg and "11 tokens" in msg and "= 51 tokens" in msg
    assert f"{51 * BYTES_PER_TOKEN} bytes" in msg and "kv_budget of 50 tokens" in msg
    assert engine.waiting == 4  # the refused one queued nothing
    while engine.step():
        pass
    assert [len(f.result().output_ids) for f in ok] == [20] * 4


def test_the_server_answers_400_for_an_oversized_request_and_serves_the_others():
    engine = RolloutEngine(tiny_qwen2(3), kv_budget=KVBudget(bytes=50 * BYTES_PER_TOKEN))

    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            good = [
                c.post("/generate", json={"input_ids": [9] * 4, "sampling_params": _sampling(30)}) for _ in range(3)
            ]
            big = c.post("/generate", json={"input_ids": [9] * 30, "sampling_params": _sampling(30)})
            return await asyncio.gather(big, *good)

    try:
        big, *good = asyncio.run(go())
    finally:
        engine.shutdown()
    assert big.status_code == 400
    assert "60 tokens" in big.json()["message"] and "kv_budget of 50 tokens" in big.json()["message"]
    assert [r.status_code for r in good] == [200] * 3
    assert [len(r.json()["output_ids"]) for r in good] == [30] * 3


def test_admission_is_fifo_and_a_large_head_request_is_not_starved():
    budget = 100
    engine = RolloutEngine(tiny_qwen2(3), start=False, max_running=64, kv_budget=KVBudget(tokens=budget))
    reserve = {}

    def submit(rid, prompt_len, max_new):
        reserve[rid] = prompt_len + max_new
        return engine.submit([8] * prompt_len, _sampling(max_new), rid=rid)

    rec = Recorder(engine, reserve)
    futs = {f"s{i}": submit(f"s{i}", 5, 10 + 5 * i) for i in range(4)}  # 15 + 20 + 25 + 30 = 90 running
    engine.step()
    futs["big"] = submit("big", 10, 80)  # 90: must wait until all four have finished
    order = ["s0", "s1", "s2", "s3", "big"]
    for step in range(200):  # small requests keep arriving; each alone would fit next to the running ones
        rid = f"t{step}"
        futs[rid] = submit(rid, 2, 3)
        order.append(rid)
        engine.step()
        if futs["big"].done():
            break
    while engine.step():
        pass
    assert futs["big"].result().meta_info.finish_reason.type == "length"
    assert rec.admitted == order  # admitted in submission order: nothing overtook the big request
    assert max(rec.accounted) <= budget
    assert all(f.result().meta_info.finish_reason.type == "length" for f in futs.values())


@pytest.mark.parametrize("mode", ["reprefill", "keep_kv", "drain"])
def test_weight_updates_keep_the_budget_and_finish_every_request(mode):
    budget = 120
    engine = RolloutEngine(
        tiny_qwen2(3), start=False, max_running=64, weight_update=mode, kv_budget=KVBudget(tokens=budget)
    )
    r = random.Random(5)
    reserve, futs = {}, {}
    for i in range(20):
        p, m = [r.randrange(4, 64) for _ in range(r.randrange(2, 20))], r.randrange(5, 30)
        reserve[f"r{i}"] = len(p) + m
        futs[f"r{i}"] = engine.submit(p, _sampling(m), rid=f"r{i}")
    rec = Recorder(engine, reserve)
    updates, step = [], 0
    while engine.step() or any(not u.done() for u in updates):
        step += 1
        if step in (5, 40):
            new = named_weights(tiny_qwen2(4 + step))
            updates.append(engine.update_weights_from_tensors(new, len(updates) + 1, "t"))
    assert all(u.done() for u in updates) and engine.version == 2
    assert max(rec.accounted) <= budget and rec.accounted == rec.independent
    for rid, f in futs.items():
        meta = f.result().meta_info
        assert meta.completion_tokens == reserve[rid] - meta.prompt_tokens
        assert meta.output_token_versions == sorted(meta.output_token_versions)
    assert any(2 in f.result().meta_info.output_token_versions for f in futs.values())


def test_aborts_free_the_reservation_for_the_next_request():
    engine = RolloutEngine(tiny_qwen2(3), start=False, kv_budget=KVBudget(tokens=60))
    a = engine.submit([6] * 10, _sampling(40), rid="a")  # 50
    b = engine.submit([6] * 10, _sampling(40), rid="b")  # waits
    c = engine.submit([6] * 5, _sampling(5), rid="c")  # waits behind b
    for _ in range(3):
        engine.step()
    assert [s.rid for s in engine._running] == ["a"] and engine.kv_reserved_tokens == 50
    assert engine.abort_request("c").done() is False  # a command: applied at the next step
    engine.step()
    assert c.result().meta_info.finish_reason.type == "abort" and engine.waiting == 1
    engine.abort_request("a")
    engine.step()
    assert a.result().meta_info.finish_reason.type == "abort"
    assert [s.rid for s in engine._running] == ["b"] and engine.kv_reserved_tokens == 50
    engine.abort_all()
    engine.step()
    assert b.result().meta_info.finish_reason.type == "abort" and engine.kv_reserved_tokens == 0
    d = engine.submit([6] * 10, _sampling(40), rid="d")
    while engine.step():
        pass
    assert len(d.result().output_ids) == 40


def _jobs(n: int = 24, greedy: bool = False) -> list[tuple[str, list[int], dict]]:
    r = random.Random(11)
    jobs = []
    for i in range(n):
        p = [r.randrange(4, 64) for _ in range(r.randrange(2, 20))]
        sp = _sampling(r.randrange(3, 30), ignore_eos=False) | ({"temperature": 0.0} if greedy else {})
        jobs.append((f"q{i}", p, sp))
    return jobs


def _outputs(engine: RolloutEngine, jobs, update_at: int | None = 12) -> list[tuple]:
    futs = [engine.submit(p, sp, rid=rid) for rid, p, sp in jobs]
    step = 0
    while engine.step():
        step += 1
        if step == update_at:
            engine.update_weights_from_tensors(named_weights(tiny_qwen2(9)), 1, "t")
    return [
        (
            f.result().output_ids,
            [lp for lp, _, _ in f.result().meta_info.output_token_logprobs],
            f.result().meta_info.output_token_versions,
        )
        for f in futs
    ]


@pytest.mark.parametrize("mode", ["reprefill", "keep_kv", "drain"])
def test_the_unbounded_default_is_unchanged_and_a_budget_that_never_binds_changes_nothing(mode):
    assert EngineConfig().kv_budget is None and RolloutConfig().kv_budget is None

    def make(**kw):
        return RolloutEngine(tiny_qwen2(3), start=False, seed=7, max_running=8, weight_update=mode, **kw)

    default = _outputs(make(), _jobs())
    assert _outputs(make(kv_budget=KVBudget(tokens=10**9)), _jobs()) == default  # tokens, logprobs, versions


def test_a_binding_budget_changes_the_schedule_not_the_answers():
    """Greedy answers do not depend on which requests share a batch (logprobs up to rounding)."""
    jobs = _jobs(greedy=True)
    bound = RolloutEngine(tiny_qwen2(3), start=False, kv_budget=KVBudget(tokens=60))
    rec = Recorder(bound, {rid: len(p) + sp["max_new_tokens"] for rid, p, sp in jobs})
    got = _outputs(bound, jobs, update_at=None)
    want = _outputs(RolloutEngine(tiny_qwen2(3), start=False), jobs, update_at=None)
    assert max(rec.accounted) <= 60 < sum(rec.reserve.values())  # the budget spread them out
    assert [o[0] for o in got] == [o[0] for o in want]
    for x, y in zip(got, want):
        assert x[1] == pytest.approx(y[1], abs=1e-4)


# -- config -------------------------------------------------------------------------------------


def test_kv_budget_config_forms():
    def load(text):
        return RolloutConfig.model_validate(yaml.safe_load(text))

    assert load("kv_budget: {tokens: 20000}").kv_budget == KVBudget(tokens=20000)
    assert load("kv_budget: {bytes: 2e9}").kv_budget.bytes == 2 * 10**9  # YAML reads 2e9 as text
    assert load("kv_budget: {bytes: 2.5e+9}").kv_budget.bytes == 25 * 10**8
    assert load("kv_budget: null").kv_budget is None
    for bad, why in (
        ("{}", "exactly one"),
        ("{tokens: 10, bytes: 10}", "exactly one"),
        ("{bytes: 1.5}", "integer"),
        ("{bytes: lots}", "integer"),
        ("{tokens: 0}", "greater than 0"),
        ("{tokens: '100'}", "integer"),
        ("{token: 100}", "Extra inputs"),
    ):
        with pytest.raises(ValidationError, match=why):
            load(f"kv_budget: {bad}")


def test_kv_budget_is_checked_against_the_backend_and_the_answer_length():
    with pytest.raises(ValidationError, match="cannot hold one request: at least 1 prompt token"):
        RolloutConfig(kv_budget={"tokens": 128}, sampling={"max_new_tokens": 128})
    # external servers: a limit the client keeps, in positions (bytes need the server's model)
    with pytest.raises(ValidationError, match="give \\{tokens: N\\}"):
        RolloutConfig(
            kv_budget={"bytes": 10**9},
            backend={"kind": "external", "urls": ["http://x"], "allow_unauthenticated": True},
        )
    ext = RolloutConfig(
        kv_budget={"tokens": 1000}, backend={"kind": "external", "urls": ["http://x"], "allow_unauthenticated": True}
    )
    assert ext.client_kv_budget_tokens() == 1000
    assert RolloutConfig(kv_budget={"tokens": 1000}).client_kv_budget_tokens() is None  # the engine's own


class _SlowServer:
    """A stand-in client for the pool test: answers after a random delay and keeps its own sum of the
    KV positions (prompt + max_new_tokens) of the requests it is serving, checked against the budget."""

    def __init__(self, url, timeout_s, budget, rng, log):
        self.url, self.budget, self.rng, self.log = url, budget, rng, log
        self.holding = 0

    async def _serve(self, size: int, n: int):
        self.holding += size
        assert self.holding <= self.budget, f"{self.url} holds {self.holding} > {self.budget}"
        self.log.append((self.url, size))
        try:
            await asyncio.sleep(self.rng.uniform(0.0, 0.01))
        finally:
            self.holding -= size
        return [Generation([1], [0.0], [0], "length") for _ in range(n)]

    async def generate(self, ids, sampling, rid=None):
        return (await self._serve(len(ids) + sampling.max_new_tokens, 1))[0]

    async def generate_batch(self, ids, sampling, rids=None):
        return await self._serve(sum(len(x) + s.max_new_tokens for x, s in zip(ids, sampling, strict=True)), len(ids))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_client_side_budget_for_external_servers_under_a_random_burst(seed):
    """RolloutPool(kv_budget_tokens): each server's requests in flight never hold more than the budget
    (the fake servers check their own sums), batches too big together go one by one, every request is
    answered, and one larger than the whole budget is refused with its size."""
    rng, log, budget = random.Random(seed), [], 400
    pool = RolloutPool(
        [f"http://s{i}" for i in range(2)],
        make_client=lambda u, t: _SlowServer(u, t, budget, rng, log),
        kv_budget_tokens=budget,
    )

    async def burst():
        jobs = []
        for _ in range(60):
            n = rng.choice([1, 1, 4])
            prompts = [[0] * rng.randint(1, 60) for _ in range(n)]
            samp = Sampling(max_new_tokens=rng.randint(1, 100))
            jobs.append(pool.generate(prompts[0], samp) if n == 1 else pool.generate_batch(prompts, [samp] * n))
        return await asyncio.gather(*jobs)

    out = asyncio.run(burst())
    assert len(out) == 60 and sum(pool.sent) == sum(1 if isinstance(o, Generation) else len(o) for o in out)
    assert 0 < pool.kv_peak <= budget and pool.kv_reserved == [0, 0]
    assert {u for u, _ in log} == {"http://s0", "http://s1"}
    with pytest.raises(ValueError, match=r"needing 401 KV positions .*kv_budget of 400 tokens"):
        asyncio.run(pool.generate([0] * 301, Sampling(max_new_tokens=100)))
    # the control: the same burst without the limit overfills the servers
    pool = RolloutPool([f"http://s{i}" for i in range(2)], make_client=lambda u, t: _SlowServer(u, t, budget, rng, log))
    with pytest.raises(AssertionError, match="holds"):
        asyncio.run(burst())


def test_kv_budget_reaches_the_server_through_the_engine_config():
    cfg = RolloutConfig(kv_budget={"bytes": 4096})
    eng = cfg.engine_config(seed=1, dtype="float32")
    assert eng.kv_budget == KVBudget(bytes=4096)
    args = parse_args(["--model-path", "m", "--port", "1", "--engine-config", eng.model_dump_json()])
    assert args.engine_config.kv_budget == KVBudget(bytes=4096)
    assert json.loads(EngineConfig().model_dump_json())["kv_budget"] is None


def test_a_trajectory_is_bounded_by_the_smallest_kv_budget_the_servers_report():
    """A budget in bytes is known in positions only to the servers (their model's size per position):
    the trajectory limit takes what they report, beside the config's own limits."""
    from pathlib import Path

    from areal_core.experiment import load_config
    from areal_core.run.budget import trajectory_token_limit

    e2e = Path(__file__).resolve().parents[1] / "data/e2e.yaml"
    in_bytes = load_config(e2e, {"rollout.kv_budget": {"bytes": 4096}})
    assert trajectory_token_limit(in_bytes, 400) == 400  # (the config alone cannot say it in positions)
    assert trajectory_token_limit(in_bytes, 400, servers_kv_tokens=300) == 300
    assert trajectory_token_limit(load_config(e2e, {"rollout.kv_budget": {"tokens": 200}}), 400, 300) == 200
