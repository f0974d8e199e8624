"""Held-out accuracy of a run's checkpoints *with* its episode (the tool-use episode,
:mod:`areal_core.episodes.tool`): greedy, on the same held-out problems and checkpoints as the
run's own single-turn, tool-free evaluation.

    areal-flow eval-tools RUN_DIR [--version N ...] [--n-problems N] [--out FILE]
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence

from areal_core.reward.result import RewardResult
from areal_core.rollout.backend import Sampling
from areal_core.types import Trajectory


class PoolContext:
    """An :class:`EpisodeContext` on rollout servers (a ``RolloutPool``) and the reward service, for
    evaluation: no training, no weight updates (so no aborted requests to continue). Every request
    samples with ``sampling``, whose ``max_new_tokens`` is a turn's default."""

    version = 0

    def __init__(self, pool, rewards, tokenizer, sampling: Sampling, tests: dict[str, list[dict] | None] | None = None):
        self.pool, self.rewards, self.tokenizer = pool, rewards, tokenizer
        self.sampling, self.tests = sampling, tests or {}
        self._n = 0

    async def generate(
        self, trajs: Sequence[Trajectory], max_new_tokens: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> None:
        async def one(t: Trajectory) -> None:
            budget = int(max_new_tokens or self.sampling.max_new_tokens)
            start = len(t.output_ids) if t.output_mask else 0
            while not t.finished:
                left = budget - (len(t.output_ids) - start)
                if left <= 0:
                    t.finish_reason = "length"
                    break
                self._n += 1
                sampling = dataclasses.replace(self.sampling, max_new_tokens=left, stop_token_ids=tuple(stop_token_ids))
                g = await self.pool.generate(t.prompt_ids + t.output_ids, sampling, rid=f"{t.traj_id}-r{self._n}")
                t.output_ids += g.output_ids
                t.output_logprobs += g.logprobs
                t.output_versions += g.versions
                if t.output_mask:
                    t.output_mask += [1] * len(g.output_ids)
                if g.finish_reason != "abort":
                    t.finish_reason = g.finish_reason

        await asyncio.gather(*(one(t) for t in trajs))

    def room(self, traj: Trajectory) -> None:
        return None  # evaluation: the servers refuse what does not fit their context

    async def grade(self, trajs: Sequence[Trajectory], texts: Sequence[str]) -> list[RewardResult]:
        return await asyncio.to_thread(
            self.rewards.grade_many,
            trajs[0].task,
            list(texts),
            [t.reference for t in trajs],
            [self.tests.get(t.group_id) for t in trajs],
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        from areal_core.data.prompting import decode_response

        return decode_response(self.tokenizer, list(ids))


def evaluate_heldout(
    run_dir: str,
    versions: Sequence[int] | None = None,
    *,
    n_problems: int | None = None,
    episode=None,
    concurrency: int = 64,
) -> dict:
    """Held-out accuracy of a run's checkpoints *with* its episode (greedy unless the run's
    ``eval.temperature`` says otherwise, the run's ``eval.n_problems`` problems): one answer per
    problem, rolled out by ``episode`` (default: the run's ``episode``), graded as in training.
    ``versions``: default the first and the latest checkpoint. Returns
    ``{"v<N>": {"accuracy", "n", "by_k", "tool_calls_mean", "wall_s"}, ...}``."""
    import time

    from areal_core.data.datasets import load_records, to_prompts
    from areal_core.episodes.config import make_episode
    from areal_core.eval.harness import load_tokenizer
    from areal_core.eval.heldout import heldout_sampling
    from areal_core.experiment import ExperimentConfig
    from areal_core.reward.service import RewardService
    from areal_core.rollout.backends import default_client
    from areal_core.rollout.backends.embedded.launcher import start_server
    from areal_core.rollout.pool import RolloutPool
    from areal_core.storage import CheckpointStore
    from areal_core.storage.fsutil import read_json

    cfg = ExperimentConfig.model_validate(read_json(f"{run_dir}/config.json"))
    episode = episode if episode is not None else make_episode(cfg.episode)
    records = load_records(cfg.data)[1][: n_problems or cfg.eval.n_problems]
    store = CheckpointStore.from_config(cfg.storage, run_dir)
    if versions is None:
        latest = store.latest()
        if latest is None:
            raise ValueError(f"{run_dir}: no checkpoint")
        versions = sorted({0, latest})
    out: dict = {}
    with RewardService(cfg.reward) as rewards:
        for v in versions:
            t0 = time.perf_counter()
            folder = store.local_copy(v)
            tokenizer = load_tokenizer(folder)
            prompts = to_prompts(records, tokenizer)
            with start_server(folder, max_running=512) as server:

                async def main(url=server.url, tokenizer=tokenizer, prompts=prompts, v=v):
                    pool = RolloutPool([url], default_client)
                    ctx = PoolContext(
                        pool, rewards, tokenizer, heldout_sampling(cfg), {f"eval-{p.id}": p.tests for p in prompts}
                    )
                    gate = asyncio.Semaphore(concurrency)

                    async def one(p):
                        t = Trajectory(
                            traj_id=f"eval-{p.id}-s0",
                            group_id=f"eval-{p.id}",
                            seq_no=0,
                            admit_version=v,
                            prompt_ids=list(p.input_ids),
                            reference=p.reference,
                            task=p.task,
                        )
                        async with gate:
                            r = (await episode.run([t], ctx))[0]
                        return t, r

                    try:
                        return await asyncio.gather(*(one(p) for p in prompts))
                    finally:
                        await pool.aclose()

                done = asyncio.run(main())
            by_k: dict[str, list[int]] = {}
            for rec, (_, r) in zip(records, done):
                by_k.setdefault(str(rec.meta.get("k", "?")), []).append(int(bool(r.correct)))
            out[f"v{v}"] = {
                "accuracy": sum(bool(r.correct) for _, r in done) / len(done),
                "n": len(done),
                "by_k": {k: round(sum(x) / len(x), 3) for k, x in sorted(by_k.items(), key=lambda kv: _num(kv[0]))},
                "tool_calls_mean": sum(t.reward_info.get("tool_calls", 0) for t, _ in done) / len(done),
                "wall_s": round(time.perf_counter() - t0, 1),
            }
    return out


def _num(k: str) -> float:
    try:
        return float(k)
    except ValueError:
        return math.inf
