"""The decode-step breakdown's arithmetic: nested parts taken apart, the parts adding up to the step;
and its wrapping of a real (tiny) engine counts decode steps only."""

from __future__ import annotations

import pytest
import torch

from bench import decode_parts


def test_parts_take_nested_calls_apart_and_add_up_to_the_step():
    s = {
        "norm1": 1.0,
        "norm2": 2.0,
        "final norm": 0.5,
        "attention": 3.0,
        "output projection": 4.0,
        "MLP with its norm": 12.0,  # norm2's 2 inside
        "LM head with the final norm": 6.5,  # the final norm's 0.5 inside
        "forward": 40.0,
        "record": 1.5,
        "decode step": 45.0,
        "step": 47.0,
    }
    p = decode_parts.parts_of(s)
    assert p["MLP"] == 10.0 and p["LM head"] == 6.0 and p["norms"] == 3.5
    assert p["projections"] == 40.0 - (1.0 + 3.0 + 4.0 + 12.0) - 6.5
    assert p["sampling"] == 45.0 - 40.0 - 1.5 and p["bookkeeping"] == 47.0 - 45.0 + 1.5
    assert set(p) == set(decode_parts.PARTS) and sum(p.values()) == pytest.approx(s["step"])


def test_a_tiny_engine_is_timed_on_its_decode_steps_only():
    from bench import models

    model = models.load("tiny")
    batch = decode_parts.prompts(4, 50, 0)
    got = decode_parts.run_batch(model, batch, 6)
    assert set(got) == set(decode_parts.PARTS) | {"total"}
    assert all(v >= 0 for k, v in got.items() if k != "projections")
    assert sum(got[k] for k in decode_parts.PARTS) == pytest.approx(got["total"])
    assert got["attention"] > 0 and got["MLP"] > 0 and got["sampling"] > 0


def test_long_context_times_each_attention_way_over_one_cache():
    rows = decode_parts.long_context("tiny", torch.float32, 24, 1)
    engine_attention, others = decode_parts.attention_ways(torch.float32)
    assert [r["way"] for r in rows] == ["as it runs", *others] and engine_attention in rows[0]["label"]
    assert all(0 < r["attention_ms"] < r["forward_ms"] for r in rows)
    assert all(r["positions"] == 24 and len(r["runs_forward_ms"]) == 1 for r in rows)
