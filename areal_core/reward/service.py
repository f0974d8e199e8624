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

One answer, one verdict: an answer whose grading raises is graded wrong with reason
``"grading failed: ..."`` (``n_failed``), and a task that fails as a whole (its worker
killed again and again, its result lost) is split, each answer graded in a task of its
own, so that only the answer that broke it is graded wrong. The callers get an error only
for what no answer causes: a sandbox the config refuses (``reward.allow_weak_sandbox``,
asked on every path, training and evaluation), a malformed item, a client shutting down.

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
from concurrent.futures import CancelledError

from areal_core.reward.config import RewardConfig
from areal_core.reward.dask_cluster import RewardCluster, external_security
from areal_core.reward.dispatch import GRADING_FAILED, TIMED_OUT, GradingInputError, failed_verdict, grade_batch
from areal_core.reward.result import RewardResult
from areal_core.reward.sandbox import WeakSandboxError

log = logging.getLogger(__name__)

RESUBMITS = 3  # per grading task, after KilledWorker
# errors a grading task delivers as errors, not verdicts: none of them is an answer's doing
NOT_A_VERDICT = (WeakSandboxError, GradingInputError, CancelledError)
PARENT_WATCH = "areal_core.reward.parent_watch"
GRADER_MODULES = ("areal_core.data.synthetic", "areal_core.reward.math", "areal_core.reward.code")


class RewardService:
    def __init__(self, cfg: RewardConfig):
        from distributed import Client

        self.cfg = cfg
        self._cluster = None
        self.n_resubmitted = 0  # grading tasks submitted again after KilledWorker
        self.n_timed_out = 0  # answers graded wrong because their grading ran past timeout_s
        self.n_failed = 0  # answers graded wrong because their grading raised or failed as a whole
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

        With code among ``tasks``, the workers whose sandbox lacks a guarantee are named: without
        ``reward.allow_weak_sandbox`` that is a ``sandbox.WeakSandboxError`` here (``training`` or
        evaluation alike), before anything is generated (each grading task checks again, for workers
        that join later); with it, a warning."""
        from areal_core.reward.math import warm_helper
        from areal_core.reward.sandbox import missing_guarantees

        if "math" in tasks:
            self.client.run(warm_helper)
        if "code" not in tasks:
            return
        weak = {w: m for w, m in self.client.run(missing_guarantees).items() if m}
        if not weak:
            return
        lacks = ", ".join(sorted({g for m in weak.values() for g in m}))
        if not self.cfg.allow_weak_sandbox:
            raise WeakSandboxError(
                f"the code sandbox of reward worker(s) {sorted(weak)} lacks: {lacks}; "
                f"{'training' if training else 'evaluation'} refuses to grade code there. Run the reward workers "
                "as root with util-linux `unshare` (namespaces mode), or set reward.allow_weak_sandbox: true "
                "(AREAL_ALLOW_WEAK_SANDBOX=1 for `areal-flow eval`) to grade anyway (docs/EVALUATION.md)"
            )
        log.warning(
            "the code sandbox of worker(s) %s lacks: %s; grading code there anyway (reward.allow_weak_sandbox: true)",
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
        """Submit one grading task (evaluation: a verdict, no partial credit); ``on_done(result, error)`` is
        called from a Dask thread (``error``: only what no answer causes, see :meth:`submit_batch`)."""
        self._submit([(task, response, reference, tests)], "all_pass", lambda rs, e: on_done(rs and rs[0], e))

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
        Each answer gets a verdict whatever happens while it is graded (see the module docstring);
        ``on_done`` gets an error only for what no answer causes: ``sandbox.WeakSandboxError`` (code in
        a sandbox that lacks a guarantee, without ``reward.allow_weak_sandbox``), a malformed item
        (``dispatch.GradingInputError``), or the client shutting down."""
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
        self._submit(merged, self.cfg.code_reward, done)

    def _submit(self, items: list[tuple], code_reward: str, on_done: Callable) -> None:
        """Grade ``items`` in one Dask task (``dispatch.grade_batch``). A task lost with its workers
        (``KilledWorker``) is submitted again, up to ``RESUBMITS`` times; a task that still fails is split,
        each item graded in a task of its own, and an item whose task alone fails is graded wrong with the
        error as its reason (:meth:`_failed`): one answer that kills its worker or breaks its grading task
        costs the others nothing."""
        from distributed.scheduler import KilledWorker

        args = (items, self.cfg.timeout_s, code_reward, self.cfg.allow_weak_sandbox)

        def attempt(k: int) -> None:
            fut = self.client.submit(grade_batch, *args, pure=False, retries=2)

            def _done(f):
                try:
                    results = f.result()
                except NOT_A_VERDICT as e:
                    on_done(None, e)
                except KilledWorker as e:
                    if k < RESUBMITS:
                        log.warning("grading task lost with its workers (%s); submitting it again", e)
                        self.n_resubmitted += 1
                        attempt(k + 1)
                        return
                    self._failed(items, code_reward, e, on_done)
                except Exception as e:  # noqa: BLE001 - the task failed as a whole: graded item by item
                    self._failed(items, code_reward, e, on_done)
                else:
                    self._count(results)
                    on_done(results, None)

            fut.add_done_callback(_done)

        attempt(0)

    def _failed(self, items: list[tuple], code_reward: str, error: BaseException, on_done: Callable) -> None:
        """A grading task failed as a whole with ``error``: one item is graded wrong with it as the reason;
        several are each graded again in a task of their own (``on_done`` gets them all, in order)."""
        if len(items) == 1:
            log.error("grading a %s answer failed as a whole (%r): graded wrong", items[0][0], error)
            self.n_failed += 1
            on_done([failed_verdict(error)], None)
            return
        log.warning("a grading task of %d answers failed (%r); grading each alone", len(items), error)
        results: list = [None] * len(items)
        errors: list = []
        left = [len(items)]
        lock = threading.Lock()

        def one(i: int):
            def got(rs, e) -> None:
                with lock:
                    if e is not None:
                        errors.append(e)
                    else:
                        results[i] = rs[0]
                    left[0] -= 1
                    last = left[0] == 0
                if last and errors:
                    on_done(None, errors[0])
                elif last:
                    on_done(results, None)

            return got

        for i, item in enumerate(items):
            self._submit([item], code_reward, one(i))

    def _count(self, results: list[RewardResult]) -> None:
        timed_out = sum(r.reason == TIMED_OUT for r in results)
        failed = sum(r.reason.startswith(GRADING_FAILED) for r in results)
        if timed_out:
            self.n_timed_out += timed_out
            log.warning(
                "%d answer(s) graded wrong: grading ran past reward.timeout_s (%gs)", timed_out, self.cfg.timeout_s
            )
        if failed:
            self.n_failed += failed
            log.warning("%d answer(s) graded wrong: their grading raised (see the worker's log)", failed)

    def grade_many(
        self, task: str, responses: list[str], references: list[str], tests: list[list[dict] | None] | None = None
    ) -> list[RewardResult]:
        """Verdicts for ``responses`` (one Dask task each); ``tests``: each one's tests (code). An answer
        whose task fails is graded wrong with the error as its reason; what no answer causes (see
        :meth:`submit_batch`) is raised."""
        n = len(responses)
        tests = tests if tests is not None else [None] * n
        if len(tests) != n:
            raise ValueError(f"{len(tests)} test lists for {n} responses")
        items = [[(task, r, ref, t)] for r, ref, t in zip(responses, references, tests)]
        futs = self.client.map(
            grade_batch,
            items,
            [self.cfg.timeout_s] * n,
            ["all_pass"] * n,
            [self.cfg.allow_weak_sandbox] * n,
            pure=False,
            retries=2,
        )
        results = []
        for fut in futs:
            try:
                results += fut.result()
            except NOT_A_VERDICT:
                raise
            except Exception as e:  # noqa: BLE001 - this answer's verdict: wrong, the error its reason (logged)
                log.error("grading a %s answer failed as a whole (%r): graded wrong", task, e)
                self.n_failed += 1
                results.append(failed_verdict(e))
        self._count([r for r in results if not r.reason.startswith(GRADING_FAILED)])
        return results

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
