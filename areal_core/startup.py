"""Starting several slow things at once: a run's Dask cluster and its rollout servers, an
evaluation's server and its graders. Each start is mostly waiting for a process to import and
come up, so they overlap well even on two cores."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor, wait


@contextlib.contextmanager
def made_on_enter(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` (a context manager that starts its work when made, like
    ``RewardService``), made and entered only when this is entered."""
    with factory(*args, **kwargs) as value:
        yield value


@contextlib.contextmanager
def entered_together(*managers):
    """Enter ``managers`` at once, each in a thread of its own, yield what they gave (in order),
    and exit them in reverse order as nested ``with`` blocks would. If one fails to enter (or the
    wait is interrupted), the others are exited once they are up, and the first error is raised."""
    with contextlib.ExitStack() as stack:
        pool = ThreadPoolExecutor(len(managers), thread_name_prefix="start")
        futures = [pool.submit(m.__enter__) for m in managers]
        try:
            wait(futures)
        finally:
            pool.shutdown(wait=True)  # nothing half-started is left behind, even on Ctrl-C
            for m, f in zip(managers, futures, strict=True):
                if f.exception() is None:
                    stack.push(m)  # its __exit__, in order: the last one entered exits first
        yield tuple(f.result() for f in futures)
