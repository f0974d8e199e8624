"""The reward service: grading runs as Dask tasks, submitted without blocking.

A local cluster (scheduler and ``n_workers`` nanny-managed workers, each its own process) is
started by default; ``scheduler_address`` connects to an existing Dask cluster instead (the same
code path: a distributed Client). Either way over TLS with certificates (``dask_cluster.py``): the
local one's are made for the run, so no other process can connect to it and run code.

A worker that dies (kill -9, OOM) is replaced by its nanny and the scheduler runs
its tasks again elsewhere. A task the scheduler gives up on (``KilledWorker``:
it was running on too many workers that died) is submitted again here, up to
``RESUBMITS`` times; a grader that raises is retried by Dask (``retries``).

Each answer's grading gets ``timeout_s`` seconds once its worker starts it
(``dispatch.grade_batch``); one that takes longer is graded wrong with reason
``"grading timed out"`` and counted in ``n_timed_out``, so a hung grader never
holds up training.

Batches are coalesced: at most one grading task per worker thread is in flight, and the
batches submitted meanwhile go out together as one task when one returns. Under load that
is one scheduler round trip for many groups (a Dask task costs a few ms of CPU across
client, scheduler and worker: at the quickstart's rate, a third of a core spent on 16
tasks a step); when idle, a batch leaves at once.

The scheduler and workers run in their own processes (``dask_cluster.RewardCluster``): in-process,
the scheduler held the trainer's GIL for a fifth of the time (docs/PERFORMANCE.md, "Where the
asynchronous trainer's time went", 2026-11-24).
Each starts in a session of its own, so a terminal's Ctrl-C reaches the run alone, which then
stops them (areal_core/interrupt.py); they exit by themselves if the run dies (parent_watch).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from areal_core.reward.config import RewardConfig
from areal_core.reward.dask_cluster import RewardCluster, external_security
from areal_core.reward.dispatch import TIMED_OUT, grade_batch, grade_within
from areal_core.reward.result import RewardResult

log = logging.getLogger(__name__)

RESUBMITS = 3  # per grading task, after KilledWorker
PARENT_WATCH = "areal_core.reward.parent_watch"
GRADER_MODULES = ("areal_core.data.synthetic", "areal_core.reward.math", "areal_core.reward.code")


class RewardService:
    def __init__(self, cfg: RewardConfig):
        from distributed import Client

        self.cfg = cfg
        self._cluster = None
        self.n_resubmitted = 0  # grading tasks submitted again after KilledWorker
        self.n_timed_out = 0  # answers graded wrong because their grading ran past timeout_s
        self.n_tasks = 0  # grading tasks submitted (coalesced batches count once)
        self._pending: list[tuple[list, Callable]] = []  # batches waiting for a free worker thread
        self._in_flight = 0
        self._coalesce_lock = threading.Lock()
        # distributed logs every worker and connection at INFO; keep the console for progress
        logging.getLogger("distributed").setLevel(max(logging.WARNING, logging.getLogger("distributed").level))
        if cfg.scheduler_address:
            self.client = Client(cfg.scheduler_address, timeout="30s", security=external_security(cfg))
        else:
            # the scheduler and nanny processes read their log level from the environment
            # (dask config `logging.distributed`): warnings and errors only, as here
            os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
            self._cluster = RewardCluster(
                cfg.n_workers,
                cfg.threads_per_worker,
                silence_logs=logging.ERROR,
                # scheduler and nannies exit when this process dies (even by SIGKILL); graders are imported
                # at worker start (a restarted one too), not in the first grading's timeout
                scheduler_kwargs={"preload": [PARENT_WATCH]},
                worker_kwargs={
                    "dashboard_address": None,
                    "preload": list(GRADER_MODULES),
                    "preload_nanny": [PARENT_WATCH],
                },
            )
            self.client = Client(self._cluster.cluster)  # (over TLS, with the cluster's certificate)
            self.client.wait_for_workers(cfg.n_workers, timeout=120)  # they start in the background
        # one grading task in flight per worker thread (an external cluster's, as it is now)
        self._max_in_flight = (
            max(1, sum(self.client.nthreads().values()))
            if cfg.scheduler_address
            else cfg.n_workers * cfg.threads_per_worker
        )

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def client_settings(self) -> dict[str, str]:
        """The ``reward.*`` settings with which another run reaches the cluster this service uses (a
        local cluster's certificate files included), for runs that share one cluster."""
        if self._cluster is not None:
            return self._cluster.client_settings()
        keys = ("scheduler_address", "tls_ca_file", "tls_client_cert", "tls_client_key")
        return {k: getattr(self.cfg, k) for k in keys if getattr(self.cfg, k)}

    def worker_pids(self) -> dict[str, int]:
        """{worker address: process id} of the workers now connected."""
        import os

        return self.client.run(os.getpid)

    def warm_up(self, tasks: set[str], training: bool = False) -> None:
        """Get the connected workers ready for answers of ``tasks`` (in the background):
        a worker checks math answers in a helper process that takes a second or more to start
        (areal_core.reward.math), which the first math answer would otherwise wait for, in a
        run's first steps. Workers that join later start theirs on first use.

        With code among ``tasks``, the workers whose sandbox lacks a guarantee are named: for
        ``training`` without ``reward.allow_weak_sandbox`` that is a ``sandbox.WeakSandboxError`` here,
        before anything is generated (``submit_batch`` checks again where each batch is graded, for
        workers that join later); otherwise a warning."""
        from areal_core.reward.math import warm_helper
        from areal_core.reward.sandbox import missing_guarantees

        if "math" in tasks:
            self.client.run(warm_helper)
        if "code" in tasks:
            weak = {w: m for w, m in self.client.run(missing_guarantees).items() if m}
            if weak:
                lacks = sorted({g for m in weak.values() for g in m})
                if training and not self.cfg.allow_weak_sandbox:
                    from areal_core.reward.sandbox import WeakSandboxError

                    raise WeakSandboxError(
                        f"the code sandbox of reward worker(s) {sorted(weak)} lacks: {', '.join(lacks)}; training "
                        "refuses to grade code there. Run the reward workers as root with util-linux `unshare` "
                        "(namespaces mode), or set reward.allow_weak_sandbox: true to grade anyway "
                        "(docs/EVALUATION.md)"
                    )
                log.warning(
                    "the code sandbox of worker(s) %s lacks: %s; training grades code there only with "
                    "reward.allow_weak_sandbox: true (docs/EVALUATION.md)",
                    sorted(weak),
                    lacks,
                )

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
    ) -> None:
        """Grade ``items`` ``(task, response, reference, tests)`` in one Dask task, together with
        any other batches waiting for a worker (see the module docstring); ``on_done(results,
        error)`` gets this batch's results in order, from a Dask thread.

        This is the training path: code answers get ``reward.code_reward``'s credit
        (``RewardResult.score`` under ``fraction``); ``submit`` and ``grade_many`` give verdicts only.
        Code is graded only in a sandbox that gives every guarantee, unless
        ``reward.allow_weak_sandbox``: otherwise ``on_done`` gets ``sandbox.WeakSandboxError``."""
        with self._coalesce_lock:
            self._pending.append((list(items), on_done))
            ready = self._take_pending()
        if ready:
            self._dispatch(ready)

    def _take_pending(self) -> list[tuple[list, Callable]]:
        """The waiting batches, if a worker thread is free (caller holds the lock)."""
        if not self._pending or self._in_flight >= self._max_in_flight:
            return []
        ready, self._pending = self._pending, []
        self._in_flight += 1
        return ready

    def _dispatch(self, batches: list[tuple[list, Callable]]) -> None:
        merged = [item for items, _ in batches for item in items]

        def done(results, error) -> None:
            with self._coalesce_lock:
                self._in_flight -= 1
                ready = self._take_pending()
            if ready:
                self._dispatch(ready)
            start = 0
            for items, on_done in batches:
                on_done(None if error is not None else results[start : start + len(items)], error)
                start += len(items)

        self.n_tasks += 1
        self._submit(grade_batch, (merged, self.cfg.timeout_s, self.cfg.code_reward, self.cfg.allow_weak_sandbox), done)

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
                except BaseException as e:  # noqa: BLE001 - delivered to the caller, which decides
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

    def grade_many(
        self, task: str, responses: list[str], references: list[str], tests: list[list[dict] | None] | None = None
    ) -> list[RewardResult]:
        """Verdicts for ``responses`` (one Dask task each); ``tests``: each one's tests (code)."""
        n = len(responses)
        tests = tests if tests is not None else [None] * n
        if len(tests) != n:
            raise ValueError(f"{len(tests)} test lists for {n} responses")
        futs = self.client.map(
            grade_within, [self.cfg.timeout_s] * n, [task] * n, responses, references, tests, pure=False, retries=2
        )
        results = self.client.gather(futs)
        self._count_timeouts(results)
        return results

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
