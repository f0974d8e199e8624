"""Faults a long run survives, in one short run on 127.0.0.1 with S3 (moto) checkpoints:

* kill -9 of the rollout server while it generates: the controller restarts it and
  resubmits the unfinished requests (continuing from what they had);
* kill -9 of the Dask worker: its nanny starts a new one and the grading is retried;
* the S3 endpoint frozen for 10 s while a checkpoint is published: the writes are
  retried with backoff and no partial version ever becomes visible.

Each time the run completes and every trajectory is trained exactly once.
(kill -9 of the trainer itself: tests/e2e/test_resume.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pandas as pd
import psutil
import pytest

import areal_core.reward.service as service_module
import areal_core.run.setup as run_module
from areal_core.controller.generation import Generator
from areal_core.experiment import load_config
from areal_core.reward.service import RewardService
from areal_core.rollout.backends.embedded import launcher
from areal_core.rollout.backends.embedded.client import GENERATE, EmbeddedClient
from areal_core.rollout.backends.embedded.launcher import EmbeddedServers
from areal_core.storage import CheckpointStore
from areal_core.storage.fsutil import ensure_bucket
from infra.s3 import MotoS3Server
from tests.done_future import DoneFuture

HERE = Path(__file__).resolve().parents[1]  # tests/
S3_OUTAGE_S = 3.0


@pytest.mark.slow
def test_run_survives_server_worker_and_s3_faults(tmp_path, monkeypatch, warm_cache):
    made: dict[str, object] = {}

    class Servers(EmbeddedServers):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["servers"] = self

    class Rewards(RewardService):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["rewards"] = self

    monkeypatch.setattr(launcher, "EmbeddedServers", Servers)
    monkeypatch.setattr(service_module, "RewardService", Rewards)  # (what the run's setup makes)
    events: dict[str, object] = {}

    with MotoS3Server() as s3:
        for k, v in s3.env(fast_timeouts=True).items():
            monkeypatch.setenv(k, v)
        ensure_bucket("s3://areal-faults")
        url = "s3://areal-faults/run"
        cfg = load_config(HERE / "data/e2e.yaml", {"storage.url": url})
        steps, B = cfg.trainer.max_steps, cfg.trainer.batch_size
        seen_versions: list[list[int]] = []
        kill_armed = threading.Event()
        original_call = EmbeddedClient._call

        async def call_then_kill(self, method, path, body=None, **kw):
            """Once armed, the next generate call on server 0 is held on the server (generation paused,
            so it waits there whatever the engine's speed) and the server is killed with SIGKILL while
            the call is in flight: its client must resubmit to the restarted server."""
            srv = made["servers"].servers[0]
            if not (kill_armed.is_set() and path == GENERATE and self.url == srv.url.rstrip("/")):
                return await original_call(self, method, path, body, **kw)
            kill_armed.clear()
            await self.pause()
            call = asyncio.ensure_future(original_call(self, method, path, body, **kw))
            deadline = time.monotonic() + 30
            while (
                await asyncio.to_thread(
                    lambda: httpx.get(
                        srv.url + "/get_model_info", timeout=5, headers={"Authorization": f"Bearer {srv.api_key}"}
                    ).json()
                )
            )["waiting"] == 0:
                assert time.monotonic() < deadline and not call.done(), "the held request never reached the server"
                await asyncio.sleep(0.01)
            events["server_pid"] = srv.pid
            events["server_running"] = psutil.Process(srv.pid).is_running()
            os.kill(srv.pid, signal.SIGKILL)
            return await call

        monkeypatch.setattr(EmbeddedClient, "_call", call_then_kill)

        def faults(row):
            step = row["step"]
            if step == 1:  # kill the server during its next generate call (above): training goes on meanwhile
                kill_armed.set()
            elif step == 4:
                pids = made["rewards"].worker_pids()
                events["worker_pids"] = set(pids.values())
                for pid in pids.values():
                    os.kill(pid, signal.SIGKILL)
            elif step == 5:  # freeze S3 from here to S3_OUTAGE_S after step 6, whose checkpoint write starts
                kill_armed.clear()  # (the server restart is over by then: a restart reads its checkpoint from S3)
                deadline = time.monotonic() + 60  # (checkpoint 3's write finishes first, or 6 would queue behind it)
                while 3 not in CheckpointStore(url).versions():
                    assert time.monotonic() < deadline, "checkpoint 3 was never published"
                    time.sleep(0.05)
                s3.pause()
                events["backstop"] = threading.Timer(120.0, s3.resume)  # (the run never hangs on the test)
                events["backstop"].start()
            elif step == 6:  # checkpoint 6's background write began before this call: S3 comes back later
                events["s3_resumed_at"] = time.monotonic() + S3_OUTAGE_S
                threading.Timer(S3_OUTAGE_S, s3.resume).start()
            elif step == 7:
                events["worker_pids_after"] = set(made["rewards"].worker_pids().values())
            seen_versions.append(CheckpointStore(url).versions() if step >= 7 else [])  # (S3 is down in step 6's hook)

        summary = run_module.run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache, on_step=faults)
        events["backstop"].cancel()
        s3.resume()

        # the run completed, every trajectory exactly once
        assert summary["ledger_check"]["ok"], summary["ledger_check"]
        assert summary["steps"] == steps and summary["final_version"] == steps
        ledger = pd.read_parquet(tmp_path / "run/ledger.parquet")
        assert len(ledger) == steps * B and not ledger["trajectory_id"].duplicated().any()

        # the rollout server: killed while generating (between steps 1 and 5), restarted, requests resubmitted
        assert events.get("server_running"), "the server never had a request in flight during steps 1-5"
        assert made["servers"].restarts >= 1 and made["servers"].servers[0].pid != events["server_pid"]
        assert summary["rollout_resubmits"] > 0

        # the Dask worker: replaced by a new process
        assert events["worker_pids_after"] and not events["worker_pids_after"] & events["worker_pids"]

        # S3: the background write of checkpoint 6 waited out the outage while training went on;
        # only complete versions, all intact
        writes = {w["version"]: w for w in summary["checkpoint_writes"]}
        resumed_at = events["s3_resumed_at"]
        started_at = writes[6]["done_at"] - writes[6]["write_s"]
        assert started_at < resumed_at, "checkpoint 6's write began after the outage: the test did not exercise it"
        assert writes[6]["done_at"] >= resumed_at - 0.1  # it could not finish while S3 was down
        store = CheckpointStore(url, cache_dir=str(tmp_path / "dl"))
        assert store.versions() == [0, 3, 6, 8]
        for v in store.versions():
            store.verify(v)
        for vs in seen_versions:  # seen during the run: always a prefix of the checkpoints
            assert vs == [0, 3, 6, 8][: len(vs)]


@pytest.mark.slow
def test_grading_survives_worker_killed_mid_batch():
    """kill -9 of the only Dask worker while it works through 500 queued gradings: its
    nanny starts a new one and the scheduler runs the lost tasks again."""
    from areal_core.reward.config import RewardConfig

    n, results, errors = 500, [], []
    done = threading.Event()
    lock = threading.Lock()

    def on_done(result, error):
        with lock:
            (errors if error is not None else results).append(error or result)
            if len(results) + len(errors) == n:
                done.set()

    with RewardService(RewardConfig(n_workers=1)) as rewards:
        before = set(rewards.worker_pids().values())
        for _ in range(n):
            rewards.submit("chain", "a1b2|2", "a1b2|2", on_done=on_done)
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:  # the worker is grading now
            time.sleep(0.01)
        assert results and len(results) < n, "the batch finished before the kill"
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        assert done.wait(180), f"{len(results)} graded, {len(errors)} errors"
        after = set(rewards.worker_pids().values())
    assert not errors and len(results) == n and all(r.correct for r in results)
    assert after and not after & before


def test_task_given_up_by_the_scheduler_is_resubmitted():
    """KilledWorker (the scheduler gave up on a task whose workers kept dying): submitted
    again, up to RESUBMITS times; then the answer is graded wrong with the error as its reason
    (one answer, one verdict: the caller gets no error to fail the run with)."""
    from distributed.scheduler import KilledWorker

    from areal_core.reward import service as service_mod
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.result import RewardResult

    graded = RewardResult(correct=True)
    for failures, expect_ok in ((2, True), (service_mod.RESUBMITS + 1, False)):
        outcomes = [KilledWorker("k", SimpleNamespace(address="tcp://w"), 0)] * failures + [[graded]]
        svc = RewardService.__new__(RewardService)
        svc.cfg = RewardConfig()
        svc.n_resubmitted = svc.n_timed_out = svc.n_failed = 0
        svc.client = type("C", (), {"submit": lambda self, *a, outcomes=outcomes, **k: DoneFuture(outcomes.pop(0))})()
        got = []
        svc.submit("chain", "x", "y", on_done=lambda r, e, got=got: got.append((r, e)))
        assert len(got) == 1
        if expect_ok:
            assert got[0] == (graded, None) and svc.n_resubmitted == failures
        else:
            ((result, error),) = got
            assert error is None and not result.correct and result.reason.startswith("grading failed: KilledWorker")
            assert svc.n_resubmitted == service_mod.RESUBMITS and svc.n_failed == 1


@pytest.mark.slow
def test_a_group_is_graded_in_one_task_in_order():
    """submit_batch: one Dask task grades a group's answers; results come back in order."""
    from distributed import get_task_stream

    from areal_core.reward.config import RewardConfig

    items = [("math", f"so the answer is {k}", str(k if k % 2 else k + 1), None) for k in range(6)]
    got = []
    with RewardService(RewardConfig(n_workers=1)) as rewards:
        done = threading.Event()
        with get_task_stream(rewards.client) as stream:  # what the workers ran
            rewards.submit_batch(items, on_done=lambda r, e: (got.append((r, e)), done.set()))
            assert done.wait(60)
        ran = [t["key"] for t in stream.data]
    ((results, error),) = got
    assert error is None and [r.correct for r in results] == [k % 2 == 1 for k in range(6)]
    assert rewards.n_tasks == 1
    assert len(ran) == 1 and str(ran[0]).startswith("grade_batch")  # not one per answer


@pytest.mark.slow
def test_batches_submitted_while_the_worker_is_busy_go_out_as_one_task():
    """Coalescing: with the only worker thread busy, 10 batches wait and then leave as one task;
    each batch still gets exactly its own results, in order."""
    from areal_core.reward.config import RewardConfig

    got: dict[int, list] = {}
    lock, all_done = threading.Lock(), threading.Event()

    def on_done(b):
        def f(results, error):  # runs in a Dask thread: record, assert in the test's thread
            with lock:
                got[b] = (error, [r.correct for r in results] if results is not None else None)
                if len(got) == 11:
                    all_done.set()

        return f

    def slow_on_request():
        """In the Dask worker: the response "slow" takes 2 s to grade; anything else as usual."""
        from areal_core.reward import dispatch

        real = dispatch.grade

        def grade(task, response, reference, tests=None):
            if response == "slow":
                time.sleep(2.0)
            return real(task, response, reference, tests)

        dispatch.grade = grade

    with RewardService(RewardConfig(n_workers=1, timeout_s=30)) as rewards:
        rewards.client.run(slow_on_request)
        rewards.submit_batch([("chain", "slow", "a1b2|2", None)], on_done(-1))  # keeps the worker busy
        for b in range(10):  # batch b: correct, wrong, wrong
            rewards.submit_batch([("chain", f"a1b2|{2 + k}", "a1b2|2", None) for k in range(3)], on_done(b))
        assert all_done.wait(120)
        assert rewards.n_tasks == 2  # the slow one, then the 10 that waited for it
    assert got[-1] == (None, [False])  # "slow" is a wrong chain
    for b in range(10):
        assert got[b] == (None, [True, False, False])


@pytest.mark.slow
def test_a_restarted_server_gets_no_request_before_it_holds_the_current_weights(tmp_path, monkeypatch, warm_cache):
    """kill -9 of rollout server 0 at step 2 or soon after of a run whose only checkpoint is v0 (eta 1, two servers, a
    multi-turn episode): the server is restarted from v0, and the current weights reach it a few seconds
    later (the resend is slowed down by 3 s here). Meanwhile server 1 finishes answers whose next turns need a
    server (it was paused at the kill and goes on once server 0 is up again, so the turns come just then), and
    three requests of the test's own go through the controller's pool. No request goes to server 0 before its
    weights are in, and no trained token is staler than eta (the
    ledger check says so for every run)."""
    from areal_core.rollout.weight_transport import WeightTransport

    made: dict[str, object] = {}
    times: dict[str, float] = {}
    calls: list[tuple[str, float]] = []  # (server url, when) of every generate call

    def on_server(i: int, action: str) -> None:
        async def go():
            c = EmbeddedClient(made["servers"].servers[i].url)
            try:
                await getattr(c, action)()
            finally:
                await c.aclose()

        asyncio.run(go())

    class Servers(EmbeddedServers):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["servers"] = self

        def restart(self, i, *a, **k):
            super().restart(i, *a, **k)
            if "restarted" not in times:  # healthy, at the checkpoint's version
                times["restarted"] = time.monotonic()
                on_server(1, "resume")

    monkeypatch.setattr(launcher, "EmbeddedServers", Servers)
    real_resend, real_call = WeightTransport.resend, EmbeddedClient._call

    real_open = Generator.open

    def recording_open(self, *a, **k):
        real_open(self, *a, **k)
        made["pool"] = self.pool  # the trainable servers' pool, as the controller routes with it

    async def slow_resend(self, clients, i):
        # A few requests of our own through the controller's pool while server 0 waits for its weights: the
        # run's own calls in this window depend on timing (which answers server 1 still has in flight, and
        # whether the staleness gate lets new groups in while the push is pending), these never do.
        sampling = cfg.rollout.sampling.to_sampling(max_new_tokens=4)
        probes = [asyncio.ensure_future(made["pool"].generate([1, 2, 3], sampling, rid=f"probe-{k}")) for k in range(3)]
        # a large model's weights take a while to arrive: the probes above are routed at once, so the
        # window needs only to be long enough for the run's own next turns to come too
        await asyncio.sleep(3.0)
        await real_resend(self, clients, i)
        times.setdefault("resent", time.monotonic())
        await asyncio.gather(*probes)

    async def recording_call(self, method, path, body=None, **kw):
        if path == GENERATE:
            calls.append((self.url, time.monotonic()))
        return await real_call(self, method, path, body, **kw)

    monkeypatch.setattr(WeightTransport, "resend", slow_resend)
    monkeypatch.setattr(Generator, "open", recording_open)
    monkeypatch.setattr(EmbeddedClient, "_call", recording_call)

    def running_on(i: int) -> int:
        async def ask():
            c = EmbeddedClient(made["servers"].servers[i].url)
            try:
                return (await c.info()).running
            finally:
                await c.aclose()

        return asyncio.run(ask())

    def in_flight_on_1(wait_s: float = 5.0) -> bool:  # a loaded machine can leave it idle at a boundary:
        # the trainer waits here a moment (the servers go on generating) rather than skip the step
        deadline = time.monotonic() + wait_s
        while running_on(1) == 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(row):  # at the first step from 2 on where server 1 has answers in flight, whose next turns
        # then come while server 0 waits for its weights (with none in flight nothing would be sent)
        if row["step"] >= 2 and "killed" not in times and in_flight_on_1():
            on_server(1, "pause")
            os.kill(made["servers"].servers[0].pid, signal.SIGKILL)
            times["killed"] = time.monotonic()

    eta = 1
    cfg = load_config(
        HERE / "data/e2e.yaml",
        {
            "rollout.n_servers": 2,
            "trainer.eta": eta,
            "trainer.max_steps": 6,
            "storage.checkpoint_every": 100,
            "episode": {"kind": "retry", "max_turns": 3},
            "rollout.sampling.max_new_tokens": 24,
        },
    )
    summary = run_module.run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache, on_step=kill)
    assert "killed" in times, "server 1 never had answers in flight at a step boundary: nothing to test"
    assert made["servers"].restarts >= 1 and "resent" in times
    url0 = made["servers"].servers[0].url
    window = [(u, t) for u, t in calls if times["restarted"] <= t < times["resent"]]
    assert len(window) >= 3, "the probes sent while server 0 waited for its weights were not seen"
    early = [t - times["restarted"] for u, t in window if u == url0]
    assert not early, f"{len(early)} generate call(s) reached the restarted server before its weights did"
    ledger = pd.read_parquet(tmp_path / "run/ledger.parquet")
    staleness = ledger["trained_by_version"] - ledger["min_token_version"]
    assert staleness.max() <= eta, ledger[staleness > eta][["trajectory_id", "trained_by_version", "min_token_version"]]
    check = summary["ledger_check"]
    assert check["ok"] and check["max_token_staleness"] <= eta and check["n_stale"] == 0, check
