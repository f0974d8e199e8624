"""Ctrl-C for a training run started from a terminal.

The terminal sends SIGINT to its foreground process group. The run's children (rollout
servers, the Dask scheduler and workers, megatron ranks, math-verify helpers) each start in a
session of their own, so the signal reaches the run alone, and the run stops them in order.

* The first Ctrl-C during training asks the run to stop: it trains no further batch, writes a
  checkpoint of the step it is on (``run_experiment(..., stop=...)``), stops its servers and
  Dask, and ``run_experiment`` raises :class:`~areal_core.run.setup.RunStopped`.
* The first Ctrl-C before training has begun interrupts the run (``KeyboardInterrupt``); what it
  started is stopped as the stack unwinds.
* A second Ctrl-C exits at once with status 130 (the children see their parent gone and exit).
* SIGTERM (``kill``, ``timeout``, a scheduler stopping the job), inside :func:`sigterm_interrupts`,
  interrupts the run wherever it is: what it started is stopped as the stack unwinds, and the run
  continues from its latest checkpoint, as after a Ctrl-C. Under a Prefect flow run Prefect's own
  handler takes the signal first (the runs are recorded Crashed), then hands it on.

The handler is process-wide: :func:`current` gives it to code that cannot be passed it (the
Prefect task that runs the experiment in the same process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a run ended by Ctrl-C

_current: CtrlC | None = None


class CtrlC:
    """Install with ``with CtrlC() as stop:``; pass ``stop`` (it has ``is_set()``) to ``run_experiment``
    and call :meth:`training` once steps run (e.g. from ``on_step``)."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._training = False
        self._previous = None

    def is_set(self) -> bool:
        return self._requested.is_set()

    def training(self, *_args) -> None:
        """From now on a first Ctrl-C stops the run at its next step instead of interrupting it."""
        self._training = True

    def _handle(self, signum, frame) -> None:
        if self._requested.is_set():
            sys.stderr.write("\ninterrupted again: exiting now\n")
            sys.stderr.flush()
            os._exit(EXIT_STATUS)
        self._requested.set()
        if not self._training:
            raise KeyboardInterrupt

    def __enter__(self) -> CtrlC:
        global _current
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        _current = self
        return self

    def __exit__(self, *exc) -> None:
        global _current
        _current = None
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def current() -> CtrlC | None:
    """The handler installed in this process, if any."""
    return _current


@contextlib.contextmanager
def sigterm_interrupts():
    """Inside the block, SIGTERM raises ``KeyboardInterrupt`` in the main thread (elsewhere: nothing
    changes), so a command ends as after a Ctrl-C: its children stopped, one line on how to continue,
    status 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
