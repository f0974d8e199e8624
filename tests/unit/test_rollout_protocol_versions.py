"""Mixed versions on the rollout protocol: a client reads a newer server's replies (fields it does not
know are ignored), while a server still refuses a request field it does not know."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from areal_core.rollout import protocol

INFO = {
    "model_path": "/m",
    "weight_version": 3,
    "max_running": 8,
    "running": 1,
    "waiting": 0,
    "paused": False,
    "weight_update": "reprefill",
    "generated_tokens": 10,
    "eos_token_id": 2,
}
RESPONSE = {
    "output_ids": [5],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "length"},
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "output_token_logprobs": [[-0.5, 5, None]],
        "output_token_versions": [3],
        "weight_version": 3,
    },
}


def test_a_client_reads_replies_with_fields_it_does_not_know():
    info = protocol.ModelInfo.model_validate_json(json.dumps({**INFO, "a_newer_field": {"x": 1}}))
    assert info.weight_version == 3 and not hasattr(info, "a_newer_field")
    newer = {**RESPONSE, "extra": 1, "meta_info": {**RESPONSE["meta_info"], "cached_tokens": 0}}
    newer["meta_info"]["finish_reason"] = {"type": "stop", "matched": 2, "length": 4}
    r = protocol.GenerateResponse.model_validate_json(json.dumps(newer))
    assert r.output_ids == [5] and r.meta_info.finish_reason.matched == 2
    assert protocol.StatusResponse.model_validate_json('{"success": true, "took_s": 1}').success
    snap = {
        "weight_version": 1,
        "requests": [
            {"rid": "a", "output_ids": [], "output_token_logprobs": [], "output_token_versions": [], "prompt_len": 3}
        ],
        "more": [],
    }
    assert protocol.RequestsSnapshot.model_validate_json(json.dumps(snap)).requests[0].rid == "a"


def test_replies_are_still_checked_for_what_they_must_hold():
    with pytest.raises(ValidationError, match="weight_version"):
        protocol.ModelInfo.model_validate_json(json.dumps({k: v for k, v in INFO.items() if k != "weight_version"}))
    with pytest.raises(ValidationError):
        protocol.ModelInfo.model_validate_json(json.dumps({**INFO, "running": "1"}))  # strict: no coercion


def test_a_server_refuses_a_request_field_it_does_not_know():
    with pytest.raises(ValidationError, match="tempreature"):
        protocol.SamplingParams.model_validate({"tempreature": 0.5})
    with pytest.raises(ValidationError, match="extra"):
        protocol.AbortRequest.model_validate({"rid": "a", "extra": 1})
