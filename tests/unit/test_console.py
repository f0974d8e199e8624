"""The console while a run's progress bar is shown: log lines print on their own lines above it."""

from __future__ import annotations

import io
import logging
import sys

from tqdm.auto import tqdm

from areal_core.run.loop import logs_above_the_bar


def _console(monkeypatch, redirect: bool) -> list[str]:
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    logger = logging.getLogger("areal-test-console")
    handler = logging.StreamHandler(sys.stderr)  # a terminal handler, as Prefect's and Dask's are
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    bar = tqdm(total=3, desc="RL demo", mininterval=0, file=sys.stderr)
    try:
        with logs_above_the_bar(redirect):
            for i in range(3):
                bar.update(1)
                logger.info("step %d/3", i + 1)
    finally:
        bar.close()
        logger.handlers = []
    return buf.getvalue().replace("\r", "\n").split("\n")


def test_log_lines_are_not_glued_to_the_bar(monkeypatch):
    lines = _console(monkeypatch, redirect=True)
    steps = [ln for ln in lines if "step" in ln]
    assert steps == ["INFO step 1/3", "INFO step 2/3", "INFO step 3/3"], lines
    glued = _console(monkeypatch, redirect=False)  # the control: without it, a bar and a log line share a line
    assert any("RL demo" in ln and "step" in ln for ln in glued), glued
