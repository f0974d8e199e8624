"""In-process Prefect clients pointed at a test's own server, and what they queued sent before it stops."""

from __future__ import annotations

import time

# in-process clients talk to a test's server through the product's own (it drains what they queued)
from infra.command_server import reporting_to as prefect_api  # noqa: F401

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


def wait_for(fn, timeout_s: float, what: str, interval: float = 2.0):
    """``fn()`` once it returns something true, polled every ``interval`` s; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
