"""The KV-growth benchmark's driver: a real (tiny) engine's long answers, each way counted right."""

from __future__ import annotations

import pytest
import torch

from areal_core.rollout.backends.embedded import onednn
from bench import kv_growth


def test_a_doubling_cache_counts_its_decode_steps_and_ends_as_long_as_the_answers_need():
    from bench import models

    got = kv_growth.run_batch(models.load("tiny"), kv_growth.prompts(2, 50, 0), 300, 2.0)
    assert got["decode_steps"] == 299 and got["tokens_per_s"] > 0
    assert got["capacity"] == 512  # 256 doubled once: 16 prompt + 300 positions
    assert got["in_place_steps"] == 0  # float32 never reads the capacity in place


@pytest.mark.skipif(
    not onednn.packable(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's torch has no oneDNN bfloat16 products (no AVX-512 or bf16 units)",
)
def test_in_bf16_growing_by_the_widening_reads_in_place_from_its_first_growth_on():
    from bench import models

    model, batch = models.load("tiny", torch.bfloat16), kv_growth.prompts(2, 50, 0)
    as_runs, doubles = (kv_growth.run_batch(model, batch, 320, g) for g in (None, 2.0))
    # the decode steps need 17..335 positions: in place from 205 (256 <= 1.25 x 205) on when the cache
    # grows to 320 and 400; doubling to 512 reads in place only up to 256
    assert (as_runs["capacity"], as_runs["in_place_steps"]) == (400, 335 - 205 + 1)
    assert (doubles["capacity"], doubles["in_place_steps"]) == (512, 256 - 205 + 1)
