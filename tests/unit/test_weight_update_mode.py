"""The weight-update mode is one typed literal (``rollout.backend.WeightUpdateMode``): every backend
maps each of its values, and the config, the simulator and the command line take exactly them."""

from __future__ import annotations

import typing

import pytest

from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WEIGHT_UPDATE_MODES, WeightUpdateMode, weight_update_mode
from areal_core.rollout.backends import sglang, vllm
from areal_core.rollout.config import EngineConfig, RolloutConfig
from flows.cli import build_parser


def test_the_modes_and_the_default():
    assert WEIGHT_UPDATE_MODES == typing.get_args(WeightUpdateMode) == ("reprefill", "keep_kv", "drain")
    assert RolloutConfig().weight_update == EngineConfig().weight_update == DEFAULT_WEIGHT_UPDATE


def test_every_backend_maps_every_mode():
    assert set(vllm.PAUSE_MODE) == set(sglang.PAUSE_MODE_FOR_UPDATE) == set(WEIGHT_UPDATE_MODES)


def test_a_wrong_mode_is_named_with_the_modes():
    assert weight_update_mode("drain") == "drain"
    with pytest.raises(ValueError, match="weight_update: must be one of reprefill, keep_kv, drain, got 'hot'"):
        weight_update_mode("hot")


def test_the_simulator_takes_the_modes():
    from areal_core.sim import SimConfig, resolve

    with pytest.raises(ValueError, match="weight_update: must be one of"):
        resolve(SimConfig(weight_update="hot"))


def test_the_command_line_offers_the_modes():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flag = next(a for a in sub.choices["plan"]._actions if a.dest == "weight_update")
    assert tuple(flag.choices) == WEIGHT_UPDATE_MODES and flag.default == DEFAULT_WEIGHT_UPDATE
