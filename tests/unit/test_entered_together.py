"""startup.entered_together: a run starts Dask and its servers at once; what started is stopped
whatever fails, in the order nested ``with`` blocks would stop it."""

from __future__ import annotations

import threading
import time

import pytest

from areal_core.startup import entered_together, made_on_enter


class Part:
    def __init__(self, name: str, log: list, fail: bool = False, delay: float = 0.0, meet=None):
        self.name, self.log, self.fail, self.delay, self.meet = name, log, fail, delay, meet
        self.thread = None

    def __enter__(self):
        self.thread = threading.current_thread().name
        if self.meet is not None:
            self.meet.wait()  # passes only once every part is starting at the same time
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError(f"{self.name} did not start")
        self.log.append(f"enter {self.name}")
        return self.name.upper()

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


def test_values_in_order_exits_reversed_and_the_starts_overlap():
    log: list[str] = []
    meet = threading.Barrier(3, timeout=30)  # one after another, the first would wait in vain (BrokenBarrierError)
    parts = [Part(name, log, meet=meet) for name in ("dask", "servers", "frozen")]
    with entered_together(*parts) as values:
        assert values == ("DASK", "SERVERS", "FROZEN")
        log.append("body")
    assert len({p.thread for p in parts}) == 3
    assert log[-4:] == ["body", "exit frozen", "exit servers", "exit dask"]


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_start_that_fails_stops_the_others_once_they_are_up(failing):
    log: list[str] = []
    parts = [Part(n, log, fail=(k == failing), delay=0.05 * k) for k, n in enumerate(("a", "b", "c"))]
    with pytest.raises(RuntimeError, match=f"{parts[failing].name} did not start"), entered_together(*parts):
        log.append("body")
    started = [p.name for k, p in enumerate(parts) if k != failing]
    assert "body" not in log
    assert sorted(x for x in log if x.startswith("enter")) == [f"enter {n}" for n in started]
    assert [x for x in log if x.startswith("exit")] == [f"exit {n}" for n in reversed(started)]


def test_an_error_in_the_body_exits_every_part():
    log: list[str] = []
    with pytest.raises(KeyError), entered_together(Part("a", log), Part("b", log)):
        raise KeyError("boom")
    assert log[-2:] == ["exit b", "exit a"]


def test_made_on_enter_makes_nothing_until_entered():
    log: list[str] = []
    lazy = made_on_enter(Part, "late", log)
    assert log == []
    with lazy as value:
        assert value == "LATE" and log == ["enter late"]
    assert log == ["enter late", "exit late"]
