"""Elastic rollout pools: servers join a running run and leave it without notice.

A pool is elastic when the run sets ``rollout.min_servers`` (servers it cannot restart then leave
the pool when they die, ``recovery.py``) or lists where joining servers are announced
(``rollout.join_from``; the serve flow's ``join_run`` writes there). :func:`watch_pool` runs on the
controller's loop every ``every_s`` seconds:

1. it reads every server's partial outputs (``Generator.partials``), so an answer whose server
   dies continues elsewhere from what it had generated a few seconds before, not from scratch;
2. it reads the announced URLs (``discover()``) and has each one not in the pool join
   (``ServerRecovery.join``: held until it holds the current weights; one that does not answer,
   such as a dead server still listed, is tried again at the next round);
3. with fewer than ``min_servers`` servers left it stops the trainer (:class:`ServersShort`, through
   the buffer): the run checkpoints the last step and stops, resumable once servers are back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from areal_core.controller.agents import TRAINABLE
from areal_core.rollout.join_list import announce, read_urls

log = logging.getLogger(__name__)

EVERY_S = 2.0  # how often partial outputs are read and joins looked for


class ServersShort(RuntimeError):
    """Fewer rollout servers than ``rollout.min_servers`` are left."""


def url_list(path: str) -> Callable[[], list[str]]:
    """``discover`` for ``rollout.join_from``: the base URLs in the file at ``path`` (a path or
    fsspec URL; one per line, ``#`` comments and blank lines skipped), read anew at each call; no
    file yet: none. ``announce`` (``rollout/join_list.py``) adds and removes URLs there."""
    return lambda: read_urls(path)


__all__ = ["EVERY_S", "ServersShort", "announce", "url_list", "watch_pool"]


async def watch_pool(
    controller,
    discover: Callable[[], list[str]] | None,
    min_servers: int | None,
    make_client: Callable,
    every_s: float = EVERY_S,
) -> None:
    """See the module docstring; ``controller``: the running ``RolloutController``."""
    pool, joining = controller.generator.pools[TRAINABLE], set()

    async def join(url: str) -> None:
        try:
            await controller.recovery.join(make_client(url))
        finally:
            joining.discard(url)

    while True:
        await controller.read_partials()
        if discover is not None:
            try:
                announced = await asyncio.to_thread(discover)
            except OSError as e:  # the list is unreadable for now: try again next time
                log.warning("cannot read the servers that join: %s", e)
                announced = []
            have = {c.url for c in pool.live()} | joining
            for url in (u for u in announced if u not in have):
                joining.add(url)
                controller.spawn(join(url))
        if min_servers is not None and len(pool.live()) < min_servers:
            controller.buffer.fail(
                ServersShort(f"{len(pool.live())} rollout server(s) left, rollout.min_servers is {min_servers}")
            )
            return
        await asyncio.sleep(every_s)
