"""Weight-update latency: pause -> load -> resume on a running rollout server.

For the tiny model and SmolLM2-135M (float32), an embedded rollout server is told, over
HTTP, to pause, take version v, and resume; each of the three calls is timed, and their
sum is the latency. Version v comes by one of:

* ``tensor``: the weight transport through shared memory (what runs use on one host);
* ``distributed``: the weight transport by torch.distributed broadcast (gloo here), through
  SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``;
* ``file`` / ``s3``: a checkpoint published with ``CheckpointStore`` to a local folder, or to
  S3 (a moto server on 127.0.0.1, ``infra/s3.py``), loaded with ``/update_weights_from_disk``.

For the transports, the trainer-side copy (``stage``) is timed too; it happens before the
pause, while the server generates. ``stall`` is the server's own figure
(``/model_info``'s ``last_update_stall_s``): the time its engine loop spent swapping the
weights in, the only time generation stops in a run (runs push without pause/resume:
the push is the ``load`` column; a reprefill server then also recomputes the in-flight
sequences' KV cache, which is not in ``stall``).

Every S3 load uses a version it has never loaded, so the download is always paid
(the server caches remote folders by URL). file:// versions are read from the page
cache after the first load, as a trainer's fresh checkpoint usually is.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from bench.common import Timer, format_table, median, progress, spread, work_dir


async def _cycle(url: str, version: int, load, stage=None) -> dict:
    """Time pause -> ``load(client)`` -> resume (and ``stage(client)`` before the pause, if given)."""
    from areal_core.rollout.backends.embedded.client import EmbeddedClient

    c = EmbeddedClient(url)
    times = {}
    try:
        if stage is not None:
            s0 = time.perf_counter()
            await stage(c)
            times["stage_s"] = time.perf_counter() - s0
        t0 = time.perf_counter()
        await c.pause()
        t1 = time.perf_counter()
        await load(c)
        t2 = time.perf_counter()
        await c.resume()
        t3 = time.perf_counter()
        info = await c.model_info()
    finally:
        await c.aclose()
    if info.weight_version != version:
        raise RuntimeError(f"server reports version {info.weight_version} after loading {version}")
    return {
        **times,
        "pause_s": t1 - t0,
        "load_s": t2 - t1,
        "resume_s": t3 - t2,
        "total_s": t3 - t0,
        "stall_s": info.last_update_stall_s,
    }


async def _connect(url: str, transport) -> None:
    from areal_core.rollout.backends.embedded.client import EmbeddedClient

    c = EmbeddedClient(url)
    try:
        await transport.connect([c])
    finally:
        await c.aclose()


def _transport_steps(transport, model, version: int):
    """(stage, load) for ``_cycle``: the trainer's copy, then the push."""

    async def stage(c) -> None:
        transport.stage(model, version)

    async def load(c) -> None:
        await transport.push([c])

    return stage, load


def _publish(store, versions: range, folder: str) -> float:
    with Timer() as t:
        for v in versions:
            store.publish_folder(v, folder, meta={"bench": True})
    return t.s / max(1, len(versions))


def bench_model(
    name: str,
    reps: int,
    s3_env: dict,
    tmp: str,
    sources: tuple[str, ...] = ("file", "s3"),
    transports: tuple[str, ...] = ("tensor", "distributed"),
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from areal_core.rollout.backends.embedded.launcher import start_server
    from areal_core.rollout.weight_transport import DistributedTransport, TensorTransport
    from areal_core.storage import CheckpointStore, ensure_bucket
    from bench import models

    folder = models.model_folder(name)
    size_mb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6
    local = CheckpointStore(os.path.join(tmp, f"ckpt-{name}"))
    bucket = f"s3://bench-{uuid.uuid4().hex[:8]}"
    old_env = {k: os.environ.get(k) for k in s3_env}
    os.environ.update(s3_env)
    try:
        ensure_bucket(bucket)
        s3 = CheckpointStore(f"{bucket}/{name}")
        stores = {"file": local, "s3": s3}
        publish_s = {src: _publish(stores[src], range(1, reps + 1), folder) for src in sources}
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rows = []
    with start_server(folder, env=s3_env, log_path=os.path.join(tmp, f"server-{name}.log")) as srv:
        version = 0
        for kind in transports:
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            transport = TensorTransport() if kind == "tensor" else DistributedTransport()
            runs = []
            try:
                asyncio.run(_connect(srv.url, transport))  # once, not timed (a run connects at its start)
                for _ in progress(range(reps), desc=f"weight_update {name} {kind}"):
                    version += 1
                    stage, load = _transport_steps(transport, model, version)
                    runs.append(asyncio.run(_cycle(srv.url, version, load, stage)))
            finally:
                transport.close()
            rows.append(
                {
                    "model": name,
                    "source": kind,
                    "checkpoint_mb": size_mb,
                    "publish_s": None,
                    "runs": runs,
                    **{k: spread([x[k] for x in runs]) for k in runs[0]},
                }
            )
        for src in sources:
            store = stores[src]
            runs = []
            for r in progress(range(1, reps + 1), desc=f"weight_update {name} {src}"):
                version += 1
                url = store.version_url(r)
                runs.append(
                    asyncio.run(_cycle(srv.url, version, lambda c, u=url, v=version: c.update_weights_from_disk(u, v)))
                )
            rows.append(
                {
                    "model": name,
                    "source": src,
                    "checkpoint_mb": size_mb,
                    "publish_s": publish_s[src],
                    "runs": runs,
                    **{k: spread([x[k] for x in runs]) for k in runs[0]},
                }
            )
    return rows


def run(quick: bool) -> dict:
    from infra.s3 import MotoS3Server

    reps = {"tiny": 3 if quick else 10, "smollm2-135m": 3 if quick else 5}  # the first update pays page faults
    # --quick leaves out SmolLM2 from S3: putting 540 MB into moto and reading it back takes ~30 s
    sources = {"tiny": ("file", "s3"), "smollm2-135m": ("file",) if quick else ("file", "s3")}
    tmp = str(work_dir("weight_update", quick))
    rows = []
    with MotoS3Server() as moto:
        for name in ("tiny", "smollm2-135m"):
            rows += bench_model(name, reps[name], moto.env(), tmp, sources[name])
    table = [
        (
            r["model"],
            r["source"],
            r["checkpoint_mb"],
            r["publish_s"],
            r.get("stage_s", {}).get("median"),
            r["pause_s"]["median"],
            r["load_s"]["median"],
            r["resume_s"]["median"],
            r["total_s"]["median"],
            r["total_s"]["max"],
            r["total_s"]["n"],
            r["stall_s"]["median"],
        )
        for r in rows
    ]
    print(
        format_table(
            [
                "model",
                "path",
                "MB",
                "publish s",
                "stage s",
                "pause s",
                "load s",
                "resume s",
                "total s (median)",
                "max",
                "n",
                "stall s",
            ],
            table,
            title="weight update: pause -> load -> resume (idle embedded server, 1 thread)",
        )
    )

    def median_of(key, model, src):  # None: left out (SmolLM2 from S3 in --quick)
        return next(
            (median([x[key] for x in r["runs"]]) for r in rows if (r["model"], r["source"]) == (model, src)), None
        )

    return {
        "setup": {
            "repetitions": reps,
            "sources": sources,
            "server": "embedded, torch_threads 1, idle",
            "s3": "moto_server on 127.0.0.1",
        },
        "rows": rows,
        "summary": {
            f"weight_update_{figure}_{m.split('-')[0]}_{s}": median_of(key, m, s)
            for figure, key in (("s", "total_s"), ("stall_s", "stall_s"))
            for m in ("tiny", "smollm2-135m")
            for s in ("tensor", "distributed", "file", "s3")
        },
    }
