"""The train task retries only what a retry can fix."""

from __future__ import annotations

from prefect.states import Failed

from areal_core.data.records import RecordError
from areal_core.experiment import ConfigError
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.weight_transport import TransportUnsupported
from areal_core.storage.checkpoints import VersionExistsError
from areal_core.storage.run_state import ResumeError
from areal_core.storage.writer import CheckpointWriteError
from tasks.training import _retry_condition, train_run, worth_retrying


def test_bad_input_is_not_retried_and_lost_servers_or_storage_are():
    final = [
        ConfigError("trainer.eta"),
        RecordError("records.jsonl, line 3"),
        VersionExistsError("v0"),
        ResumeError("config differs"),
        TransportUnsupported("tensor"),
        ValueError("max() arg is empty"),
    ]
    transient = [
        RolloutServerError("http://x", None, "reset"),
        CheckpointWriteError("s3 timeout"),
        ConnectionError("refused"),
        OSError("disk"),
        TimeoutError(),
    ]
    assert not any(worth_retrying(e) for e in final)
    assert all(worth_retrying(e) for e in transient)
    assert train_run.retries == 1 and train_run.retry_condition_fn is _retry_condition
    assert _retry_condition(train_run, None, Failed(data=ConfigError("x"))) is False
    assert _retry_condition(train_run, None, Failed(data=OSError("x"))) is True
