"""Load test: N concurrent generate requests on one embedded rollout server, and M grading
tasks on the reward service. Reports errors, wall time, throughput and memory (RSS).

    .venv/bin/python bench/load_test.py [--requests 1000] [--tasks 10000] [--max-new-tokens 32]
                                        [--rounds 2] [--json OUT.json]

The server runs the quickstart's tiny model architecture with random weights (answers
run to max_new_tokens, the worst case for the KV cache). Its RSS is sampled every 0.1 s;
with several rounds, "bounded" means the peak of the last round is not above the first's
by more than a few MB. tests/e2e/test_load.py runs the same functions with smaller counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends import default_client
from areal_core.rollout.backends.embedded.launcher import start_server
from areal_core.rollout.pool import RolloutPool

MB = 1 << 20


def tiny_model_dir(folder: str) -> str:
    """The quickstart's tiny architecture with random weights, saved as an HF folder."""
    from areal_core.models.config import TinyArch
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny(
        TinyArch(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512), tok, seed=0
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class RssSampler:
    """Peak RSS of one process, sampled in a background thread."""

    def __init__(self, pid: int, every_s: float = 0.1):
        self.proc, self.every_s = psutil.Process(pid), every_s
        self.start_rss = self.proc.memory_info().rss
        self.peak = self.start_rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        end = self.proc.memory_info().rss
        return {"rss_start_mb": self.start_rss / MB, "rss_peak_mb": self.peak / MB, "rss_end_mb": end / MB}


async def _generate_all(url: str, n: int, max_new_tokens: int) -> tuple[int, list[str], int]:
    pool = RolloutPool([url], default_client, timeout_s=1800)
    sampling = Sampling(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)

    async def one(k: int):
        prompt = [2 + (k * 7 + j) % 20 for j in range(8 + k % 17)]
        return await pool.generate(prompt, sampling, rid=f"load-{k}")

    try:
        results = await asyncio.gather(*(one(k) for k in range(n)), return_exceptions=True)
    finally:
        await pool.aclose()
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    tokens = sum(len(r.output_ids) for r in results if not isinstance(r, BaseException))
    ok = sum(1 for r in results if not isinstance(r, BaseException) and len(r.output_ids) == max_new_tokens)
    return ok, errors, tokens


def generate_load(model_dir: str, n: int, max_new_tokens: int = 32, rounds: int = 1, max_running: int = 256) -> dict:
    """``rounds`` x ``n`` concurrent generate requests against one fresh embedded server."""
    with start_server(model_dir, max_running=max_running) as srv:
        out = {"requests": n, "rounds": [], "max_running": max_running, "max_new_tokens": max_new_tokens}
        for _ in range(rounds):
            rss = RssSampler(srv.pid)
            t0 = time.perf_counter()
            ok, errors, tokens = asyncio.run(_generate_all(srv.url, n, max_new_tokens))
            wall = time.perf_counter() - t0
            out["rounds"].append(
                {
                    "ok": ok,
                    "errors": len(errors),
                    "first_errors": errors[:3],
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall,
                    **rss.stop(),
                }
            )
        out["server_alive"] = srv.alive()
    return out


def reward_load(n: int, n_workers: int = 1) -> dict:
    """``n`` chain-grading tasks submitted at once through RewardService.submit (the controller's path)."""
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    done, errors, correct = threading.Event(), [], [0]
    lock, count = threading.Lock(), [0]

    def on_done(result, error):
        with lock:
            if error is not None:
                errors.append(repr(error))
            elif result.correct:
                correct[0] += 1
            count[0] += 1
            if count[0] == n:
                done.set()

    with RewardService(RewardConfig(n_workers=n_workers)) as rewards:
        rss = RssSampler(os.getpid())
        t0 = time.perf_counter()
        for k in range(n):
            a, b = k % 9 + 1, k % 7 + 1
            ref = f"a{a}b{a + b}|{a + b}"
            response = ref if k % 2 == 0 else f"a{a}b{a + b + 1}|{a + b + 1}"
            rewards.submit("chain", response, ref, on_done=on_done)
        finished = done.wait(timeout=max(120.0, n / 20))
        wall = time.perf_counter() - t0
        mem = rss.stop()
    return {
        "tasks": n,
        "completed": count[0],
        "finished": finished,
        "errors": len(errors),
        "first_errors": errors[:3],
        "correct": correct[0],
        "wall_s": wall,
        "tasks_per_s": count[0] / wall,
        "resubmitted": rewards.n_resubmitted,
        "main_process": mem,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=10000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="load-test-") as tmp:
        gen = generate_load(tiny_model_dir(tmp), args.requests, args.max_new_tokens, args.rounds)
    print(json.dumps({"generate": gen}, indent=2), flush=True)
    rew = reward_load(args.tasks)
    print(json.dumps({"reward": rew}, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"generate": gen, "reward": rew}, indent=2))
    ok = (
        all(r["errors"] == 0 and r["ok"] == args.requests for r in gen["rounds"])
        and rew["errors"] == 0
        and rew["completed"] == args.tasks
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
