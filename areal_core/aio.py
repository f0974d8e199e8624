"""Handing a result from a plain thread to a future of an event loop."""

from __future__ import annotations

import asyncio


def _settle(fut: asyncio.Future, value, error: BaseException | None) -> None:
    if fut.done():  # given up on (cancelled) meanwhile
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)


def settle_threadsafe(fut: asyncio.Future, value, error: BaseException | None = None) -> None:
    """From any thread: resolve ``fut`` with ``value``, or with ``error`` where it is not None, on its
    loop. A future given up on is left as it is; a loop closed meanwhile has nobody waiting, and the
    result is dropped."""
    loop = fut.get_loop()
    try:
        loop.call_soon_threadsafe(_settle, fut, value, error)
    except RuntimeError:
        if not loop.is_closed():
            raise
