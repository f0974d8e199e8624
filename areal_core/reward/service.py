"""The reward service: grading runs as Dask tasks, submitted without blocking.

A LocalCluster is started by default; ``scheduler_address`` connects to an
existing Dask cluster instead (the same code path: a distributed Client).

A worker that dies (kill -9, OOM) is replaced by its nanny and the scheduler runs
its tasks again elsewhere. A task the scheduler gives up on (``KilledWorker``:
it was running on too many workers that died) is submitted again here, up to
``RESUBMITS`` times; a grader that raises is retried by Dask (``retries``).

Each answer's grading gets ``timeout_s`` seconds once its worker starts it
(``dispatch.grade_within``); one that takes longer is graded wrong with reason
``"grading timed out"`` and counted in ``n_timed_out``, so a hung grader never
holds up training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import TIMED_OUT, grade_batch, grade_within
from areal_core.reward.result import RewardResult

log = logging.getLogger(__name__)

RESUBMITS = 3  # per grading task, after KilledWorker


class RewardService:
    def __init__(self, cfg: RewardConfig):
        from distributed import Client, LocalCluster

        self.cfg = cfg
        self._cluster = None
        self.n_resubmitted = 0  # grading tasks submitted again after KilledWorker
        self.n_timed_out = 0  # answers graded wrong because their grading ran past timeout_s
        # distributed logs every worker and connection at INFO; keep the console for progress
        logging.getLogger("distributed").setLevel(max(logging.WARNING, logging.getLogger("distributed").level))
        if cfg.scheduler_address:
            self.client = Client(cfg.scheduler_address, timeout="30s")
        else:
            self._cluster = LocalCluster(
                n_workers=cfg.n_workers,
                threads_per_worker=cfg.threads_per_worker,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                worker_dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            self.client = Client(self._cluster)

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def worker_pids(self) -> dict[str, int]:
        """{worker address: process id} of the workers now connected."""
        import os

        return self.client.run(os.getpid)

    def submit(
        self,
        task: str,
        response: str,
        reference: str,
        on_done: Callable[[RewardResult | None, BaseException | None], None],
        tests: list[dict] | None = None,
    ):
        """Submit one grading task; ``on_done(result, error)`` is called from a Dask thread."""
        return self._submit(grade_within, (self.cfg.timeout_s, task, response, reference, tests), on_done)

    def submit_batch(
        self,
        items: list[tuple[str, str, str, list[dict] | None]],
        on_done: Callable[[list[RewardResult] | None, BaseException | None], None],
    ):
        """Grade ``items`` ``(task, response, reference, tests)`` in ONE Dask task (a group of
        answers: one scheduler round trip instead of one each); ``on_done(results, error)``."""
        return self._submit(grade_batch, (list(items), self.cfg.timeout_s), on_done)

    def _submit(self, fn, args: tuple, on_done):
        from distributed.scheduler import KilledWorker

        def attempt(k: int):
            fut = self.client.submit(fn, *args, pure=False, retries=2)

            def _done(f):
                try:
                    result = f.result()
                except KilledWorker as e:
                    if k < RESUBMITS:
                        log.warning("grading task lost with its workers (%s); submitting it again", e)
                        self.n_resubmitted += 1
                        attempt(k + 1)
                        return
                    on_done(None, e)
                except BaseException as e:  # delivered to the caller, which decides
                    on_done(None, e)
                else:
                    self._count_timeouts(result if isinstance(result, list) else [result])
                    on_done(result, None)

            fut.add_done_callback(_done)
            return fut

        return attempt(0)

    def _count_timeouts(self, results: list[RewardResult]) -> None:
        n = sum(r.reason == TIMED_OUT for r in results)
        if n:
            self.n_timed_out += n
            log.warning("%d answer(s) graded wrong: grading ran past reward.timeout_s (%gs)", n, self.cfg.timeout_s)

    def grade_many(self, task: str, responses: list[str], references: list[str]) -> list[RewardResult]:
        n = len(responses)
        futs = self.client.map(grade_within, [self.cfg.timeout_s] * n, [task] * n, responses, references,
                               pure=False, retries=2)
        results = self.client.gather(futs)
        self._count_timeouts(results)
        return results

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
