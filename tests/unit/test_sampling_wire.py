"""One sampling record (``rollout.backend.Sampling``) and, per backend, one function that turns it into
that backend's wire form: no field of the record is lost on the way to any server."""

from __future__ import annotations

import dataclasses

import pytest

from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends import sglang, vllm
from areal_core.rollout.backends.embedded import client as embedded
from areal_core.rollout.config import SamplingConfig

BASE = Sampling(max_new_tokens=8)
OTHER = {  # a value other than BASE's for every field
    "max_new_tokens": 9,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "stop_token_ids": (3,),
    "ignore_eos": True,
    "seed": 7,
}
BACKENDS = {"embedded": embedded.sampling_params, "sglang": sglang.sampling_params, "vllm": vllm.sampling_params}


def _wire(backend: str, s: Sampling) -> dict:
    out = BACKENDS[backend](s)
    return out if isinstance(out, dict) else out.model_dump()


def test_the_cases_cover_every_field():
    assert set(OTHER) == {f.name for f in dataclasses.fields(Sampling)}


@pytest.mark.parametrize("field", sorted(OTHER))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_field_reaches_every_backends_wire_form(backend, field):
    assert _wire(backend, dataclasses.replace(BASE, **{field: OTHER[field]})) != _wire(backend, BASE)


def test_the_config_gives_the_record_with_changes():
    s = SamplingConfig(temperature=0.7, max_new_tokens=64).to_sampling(max_new_tokens=5, ignore_eos=True)
    assert s == Sampling(max_new_tokens=5, temperature=0.7, ignore_eos=True)
