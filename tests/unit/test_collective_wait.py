"""How the distributed weight transport waits for a collective (a group's rendezvous, a broadcast) and
its members' requests (``until_a_member_fails``), with threads and coroutines standing in for gloo
and the servers: the first member's failure ends the wait while the collective still blocks; a
collective that fails first waits a little for the member that names the loss; a blocked collective
is left to a daemon thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal_core.rollout import weight_transport
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.weight_transport import _Collective, until_a_member_fails


async def _answers(after_s: float, value=None):
    await asyncio.sleep(after_s)
    return value


async def _fails(after_s: float, error: BaseException):
    await asyncio.sleep(after_s)
    raise error


def _blocked(release: threading.Event) -> str:
    release.wait(30)
    return "late"


def test_every_member_answering_gives_the_collectives_result():
    async def go():
        return await until_a_member_fails(_Collective(lambda: "group"), [_answers(0.01), _answers(0.02)])

    assert asyncio.run(go()) == "group"


def test_a_member_that_fails_ends_the_wait_while_the_collective_blocks():
    release = threading.Event()
    lost = RolloutServerError("http://b", None, "connection refused")

    async def go():
        collective = _Collective(_blocked, release)
        with pytest.raises(RolloutServerError) as e:
            await asyncio.wait_for(until_a_member_fails(collective, [_answers(60), _fails(0.05, lost)]), 10)
        return e.value, collective

    try:
        error, collective = asyncio.run(go())  # (asyncio.run's end does not wait for the blocked thread)
        assert error is lost
        assert not collective.done.is_set()
        blocked = [t for t in threading.enumerate() if t.name.startswith("weights-")]
        assert blocked and all(t.daemon for t in blocked)
    finally:
        release.set()


def test_a_lost_member_is_named_before_another_members_refusal():
    refused = RolloutServerError("http://a", 400, "no such group")
    lost = RolloutServerError("http://b", None, "connection reset")

    async def go():
        await until_a_member_fails(_Collective(lambda: None), [_fails(0.05, refused), _fails(0.05, lost)])

    with pytest.raises(RolloutServerError) as e:
        asyncio.run(go())
    assert e.value is lost


def test_a_failed_collective_waits_for_the_member_that_names_the_loss(monkeypatch):
    monkeypatch.setattr(weight_transport, "NAME_THE_FAILED_S", 5.0)
    lost = RolloutServerError("http://b", None, "connection reset")

    def closed():
        raise RuntimeError("Connection closed by peer")

    async def go():
        await until_a_member_fails(_Collective(closed), [_answers(60), _fails(0.2, lost)])

    with pytest.raises(RolloutServerError) as e:
        asyncio.run(go())
    assert e.value is lost


def test_a_failed_collective_whose_members_never_answer_raises_its_own_error(monkeypatch):
    monkeypatch.setattr(weight_transport, "NAME_THE_FAILED_S", 0.2)

    def closed():
        raise RuntimeError("Connection closed by peer")

    async def go():
        await asyncio.wait_for(until_a_member_fails(_Collective(closed), [_answers(60), _answers(60)]), 10)

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        asyncio.run(go())
