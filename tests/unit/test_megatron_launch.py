"""Followers that ``local_ranks`` started and that end other than cleanly are reported, not ignored."""

import os
import signal

import pytest

from areal_core.trainer.megatron.launch import local_ranks


@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGKILL])
def test_a_follower_that_dies_is_an_error_naming_its_rank_and_log(tmp_path, monkeypatch, sig):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError) as err, local_ranks(3, 1, tmp_path) as procs:
        assert os.environ["RANK"] == "0" and len(procs) == 2
        procs[1].send_signal(sig)  # rank 2; rank 1 stays alive, waiting for a rank 0 that never comes
        procs[1].wait()
        procs[0].terminate()
        procs[0].wait()
    text = str(err.value)
    assert f"megatron rank 2 was killed by {sig.name}" in text
    assert str(tmp_path / "megatron_rank2.log") in text
    assert "megatron rank 1 was killed by SIGTERM" in text
    assert dict(os.environ) == before  # the rendezvous variables are gone again
    assert all(p.poll() is not None for p in procs)
