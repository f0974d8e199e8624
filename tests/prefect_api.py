"""In-process Prefect clients pointed at a test's own server, and what they queued sent before it stops."""

from __future__ import annotations

import contextlib
import time

from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

# every deployment prefect.yaml declares (tests/unit/test_deployments.py holds prefect.yaml to this list)
DEPLOYMENTS = frozenset(
    {
        "campaign",
        "sweep",
        "train",
        "evaluate",
        "report",
        "replay",
        "provision",
        "prepare-data",
        "plan",
        "rollout-servers",
    }
)


@contextlib.contextmanager
def prefect_api(url: str):
    """Talk to the Prefect API at ``url`` inside the block. On leaving it, the flow logs and events that
    background workers still hold are sent while that server is up: left queued, they would be retried
    against a stopped server when pytest exits, which then never ends ("Still processing items")."""
    with temporary_settings({PREFECT_API_URL: url}):
        try:
            yield
        finally:
            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)


def wait_for(fn, timeout_s: float, what: str, interval: float = 2.0):
    """``fn()`` once it returns something true, polled every ``interval`` s; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
