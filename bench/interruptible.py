"""Generation under weight updates, by weight-update mode (paper Fig. 6, plus PipelineRL's keep_kv).

An embedded rollout server (tiny model, one thread, max_running 256) is kept busy by a
closed loop of C concurrent requests: each request that finishes is replaced at once.
Answer lengths are heavy-tailed (lognormal, median 40 tokens, up to 480; ``ignore_eos``
so the length is what was asked). Meanwhile a "trainer" loop does what ``run.py`` does:
a training step (here: ``cadence_s`` of sleep), then a push of new weights through the
tensor transport (alternating two models) and a wait until they are live.

* reprefill (AReaL's interruptible generation): the update applies between two decode
  steps; unfinished sequences are re-prefilled under the new weights and go on;
* keep_kv (PipelineRL): the update applies between two decode steps; unfinished sequences
  go on over the KV cache computed by the old weights;
* drain (the synchronous baseline's mode): the server stops admitting, lets the running
  sequences finish (the long tail decodes at a small batch), then loads.

``interruptible_gain`` = the better in-flight mode (reprefill or keep_kv) over drain.

Generation throughput = tokens the server generated (``generated_tokens`` of
``/get_model_info``) in the measured window / window length. The modes run one
after the other, rotating their order over repetitions, on servers started the same way.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

from bench.common import format_table, median, progress, ratio, spread, work_dir

CONCURRENCY = 128
MAX_NEW = 480
PROMPT_LEN = (6, 26)


def _length(rng: random.Random) -> int:
    return max(4, min(MAX_NEW, int(rng.lognormvariate(math.log(40), 1.0))))


async def _measure(url: str, models: list, cadence_s: float, warmup_s: float, window_s: float, seed: int) -> dict:
    from areal_core.rollout.backend import Sampling
    from areal_core.rollout.backends.embedded.client import EmbeddedClient
    from areal_core.rollout.weight_transport import TensorTransport

    gen = EmbeddedClient(url)
    ctl = EmbeddedClient(url)
    rng = random.Random(seed)
    stop = asyncio.Event()
    done_tokens = [0]
    update_lat: list[float] = []

    async def worker() -> None:
        while not stop.is_set():
            prompt = [rng.randrange(3, 60) for _ in range(rng.randint(*PROMPT_LEN))]
            r = await gen.generate(prompt, Sampling(temperature=1.0, max_new_tokens=_length(rng), ignore_eos=True))
            done_tokens[0] += len(r.output_ids)

    transport = TensorTransport()

    async def trainer() -> None:
        version = (await ctl.model_info()).weight_version
        await transport.connect([ctl])
        while not stop.is_set():
            await asyncio.sleep(cadence_s)  # the training step; then publish and wait until live (run.py)
            if stop.is_set():
                return
            version += 1
            t0 = time.perf_counter()
            transport.stage(models[version % 2], version)
            await transport.push([ctl])
            update_lat.append(time.perf_counter() - t0)

    tasks = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)] + [asyncio.create_task(trainer())]
    try:
        await asyncio.sleep(warmup_s)
        i0 = await ctl.model_info()
        t0, d0, n_up0 = time.perf_counter(), done_tokens[0], len(update_lat)
        await asyncio.sleep(window_s)
        i1 = await ctl.model_info()
        t1, d1, n_up1 = time.perf_counter(), done_tokens[0], len(update_lat)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gen.aclose()
        await ctl.aclose()
        transport.close()
    return {
        "generated_tokens_per_s": (i1.generated_tokens - i0.generated_tokens) / (t1 - t0),
        "finished_tokens_per_s": (d1 - d0) / (t1 - t0),
        "updates_in_window": n_up1 - n_up0,
        "update_latency_s": update_lat[n_up0:n_up1] or update_lat[-1:],
        "window_s": t1 - t0,
    }


def _models(tmp: str) -> tuple[str, list]:
    """A folder the servers start from, and two models whose weights are pushed in turn."""
    from bench.models import build_tiny_model

    models = [build_tiny_model(seed) for seed in (1, 2)]
    folder = os.path.join(tmp, "tiny-v1")
    models[0][0].save_pretrained(folder)
    models[0][1].save_pretrained(folder)
    return folder, [m for m, _ in models]


def run(quick: bool) -> dict:
    from areal_core.rollout.backends.embedded.launcher import start_server

    reps = 1 if quick else 3
    warmup_s, window_s = (2.0, 5.0) if quick else (6.0, 30.0)
    cadence_s = 1.0  # about one quickstart training step on this machine
    tmp = str(work_dir("interruptible", quick))
    folder, models = _models(tmp)
    res: dict[str, list[dict]] = {"reprefill": [], "keep_kv": [], "drain": []}
    for r in progress(range(reps), desc="weight-update modes"):
        order = list(res)[r % 3 :] + list(res)[: r % 3]
        for mode in order:
            with start_server(
                folder, weight_update=mode, max_running=256, log_path=os.path.join(tmp, f"server-{mode}-{r}.log")
            ) as srv:
                res[mode].append(asyncio.run(_measure(srv.url, models, cadence_s, warmup_s, window_s, seed=r)))
    rows = []
    for mode, runs in res.items():
        lat = [x for run in runs for x in run["update_latency_s"]]
        rows.append(
            (
                mode,
                median([x["generated_tokens_per_s"] for x in runs]),
                median([x["finished_tokens_per_s"] for x in runs]),
                median([x["updates_in_window"] for x in runs]),
                median(lat) if lat else None,
                max(lat) if lat else None,
            )
        )
    by_mode = {row[0]: row[1] for row in rows}
    best = max(("reprefill", "keep_kv"), key=lambda m: by_mode[m] or 0)
    gain = ratio(by_mode[best], by_mode["drain"])
    print(
        format_table(
            [
                "weight update",
                "generated tok/s",
                "finished tok/s",
                "updates/window",
                "update s (median)",
                "update s (max)",
            ],
            rows,
            title=f"generation throughput under weight updates every {cadence_s:.0f}s, tiny model, "
            f"{CONCURRENCY} concurrent requests, {reps}x{window_s:.0f}s windows",
        )
    )
    print(f"interruptible gain ({best} over drain): {gain:.3f}x" if gain else "interruptible gain: -")
    return {
        "setup": {
            "model": "tiny (quickstart shape)",
            "concurrency": CONCURRENCY,
            "update_cadence_s": cadence_s,
            "answer_lengths": f"lognormal median 40, sigma 1, clipped to [4, {MAX_NEW}], ignore_eos",
            "warmup_s": warmup_s,
            "window_s": window_s,
            "repetitions": reps,
            "server_threads": 1,
        },
        "modes": {
            m: {"generated_tokens_per_s": spread([x["generated_tokens_per_s"] for x in runs]), "runs": runs}
            for m, runs in res.items()
        },
        "summary": {
            "interruptible_gain": gain,
            "interruptible_best_mode": best,
            "keep_kv_over_reprefill": ratio(by_mode["keep_kv"], by_mode["reprefill"]),
        },
    }
