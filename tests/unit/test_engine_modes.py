"""Weight-update modes of the engine (keep_kv against an independent HF reference), abort by
request id, and a stopped engine answering 503 (restartable) rather than 500."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest
import torch
from transformers import DynamicCache

from areal_core.rollout.backends.embedded.engine import EngineStopped, RolloutEngine
from areal_core.rollout.backends.embedded.server import create_app
from areal_core.rollout.weight_transport import named_weights
from tests.e2e.test_rollout_server import tiny_qwen2

PROMPT = [5, 9, 13, 17, 21]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _steps_until(engine: RolloutEngine, n_out: int) -> None:
    for _ in range(100):
        if engine._running and len(engine._running[0].out) >= n_out:
            return
        engine.step()
    raise AssertionError(f"no sequence reached {n_out} tokens")


@torch.no_grad()
def _reference_keep_kv(old, new, prompt: list[int], out_before: list[int], n_after: int):
    """HF: the old model's cache over prompt + out_before[:-1], then the NEW model decodes from
    out_before[-1] on that cache (greedy): the tokens and logprobs keep_kv must produce."""
    cache = DynamicCache(config=old.config)
    # (transformers renamed the argument; the old name goes in 5.40)
    arg = "cache" if "cache" in inspect.signature(old.forward).parameters else "past_key_values"
    old(torch.tensor([prompt + out_before[:-1]]), use_cache=True, **{arg: cache})
    tok, toks, lps = out_before[-1], [], []
    for _ in range(n_after):
        logits = new(torch.tensor([[tok]]), use_cache=True, **{arg: cache}).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logits))
        toks.append(tok)
        lps.append(float(logp[tok]))
    return toks, lps


@torch.no_grad()
def _reference_fresh(new, prompt: list[int], out_before: list[int], n_after: int):
    """HF: the new model alone over everything so far (what reprefill must produce)."""
    ids, toks, lps = prompt + out_before, [], []
    for _ in range(n_after):
        logits = new(torch.tensor([ids])).logits[0, -1].float()
        tok = int(torch.argmax(logits))
        toks.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids = ids + [tok]
    return toks, lps


@pytest.mark.parametrize("mode", ["keep_kv", "reprefill"])
def test_in_flight_update_continues_as_the_mode_says(mode):
    old, new = tiny_qwen2(3), tiny_qwen2(4)
    engine = RolloutEngine(tiny_qwen2(3), start=False, weight_update=mode)
    fut = engine.submit(PROMPT, GREEDY, rid="a")
    _steps_until(engine, 3)
    before = list(engine._running[0].out)
    engine.update_weights_from_tensors(named_weights(new), 1, "test")
    while engine.step():
        pass
    resp = fut.result(timeout=5)
    n_before = len(before)
    out, lps = resp.output_ids, [lp for lp, _, _ in resp.meta_info.output_token_logprobs]
    assert out[:n_before] == before
    assert resp.meta_info.output_token_versions == [0] * n_before + [1] * (8 - n_before)  # both versions
    ref = (
        _reference_keep_kv(old, new, PROMPT, before, 8 - n_before)
        if mode == "keep_kv"
        else _reference_fresh(new, PROMPT, before, 8 - n_before)
    )
    assert out[n_before:] == ref[0]
    assert lps[n_before:] == pytest.approx(ref[1], abs=1e-4)
    other = (
        _reference_fresh(new, PROMPT, before, 8 - n_before)
        if mode == "keep_kv"
        else _reference_keep_kv(old, new, PROMPT, before, 8 - n_before)
    )
    assert lps[n_before:] != pytest.approx(other[1], abs=1e-4)  # the two modes are told apart


def test_drain_finishes_in_flight_sequences_on_the_old_weights():
    engine = RolloutEngine(tiny_qwen2(3), start=False, weight_update="drain")
    fut = engine.submit(PROMPT, GREEDY, rid="a")
    _steps_until(engine, 3)
    upd = engine.update_weights_from_tensors(named_weights(tiny_qwen2(4)), 1, "test")
    later = engine.submit(PROMPT, GREEDY, rid="b")  # must wait for the update
    while engine.step():
        pass
    assert upd.done() and fut.result().meta_info.output_token_versions == [0] * 8
    assert later.result().meta_info.output_token_versions == [1] * 8


def test_abort_request_by_rid_returns_the_partial_output_and_spares_the_rest():
    engine = RolloutEngine(tiny_qwen2(3), start=False)
    a = engine.submit(PROMPT, GREEDY, rid="a")
    b = engine.submit(PROMPT[:3], GREEDY, rid="b")
    queued = engine.submit(PROMPT, GREEDY, rid="c")
    _steps_until(engine, 2)
    found = [engine.abort_request(r) for r in ("a", "nope")]
    engine.step()
    assert [f.result() for f in found] == [True, False]
    ra = a.result(timeout=5)
    assert ra.meta_info.finish_reason.type == "abort" and 0 < len(ra.output_ids) < 8
    while engine.step():
        pass
    assert b.result().meta_info.finish_reason.type == "length" and len(b.result().output_ids) == 8
    assert queued.result().meta_info.finish_reason.type == "length"


def test_a_request_of_a_stopping_engine_gets_503(monkeypatch):
    engine = RolloutEngine(tiny_qwen2(3), start=True)

    def stopped(*a, **k):
        raise EngineStopped("the rollout engine is shut down")

    monkeypatch.setattr(engine.kv, "prefill", stopped)

    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
            missing = await c.post("/abort_request", json={})
            return r, missing

    try:
        r, missing = asyncio.run(go())
    finally:
        engine.shutdown()
    assert r.status_code == 503 and "shut down" in r.json()["message"]
    assert missing.status_code == 400 and "rid" in missing.json()["message"]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="weight_update: must be one of reprefill, keep_kv, drain"):
        RolloutEngine(tiny_qwen2(3), start=False, weight_update="interruptible")
