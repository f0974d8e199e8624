"""What a rollout server's process spends before it serves: ``python -m bench server_start [--quick]``.

Every run starts its rollout servers, and a preempted or crashed one is started again: what a
server's process computes before its first request is paid at each start, on the server's own CPU.
The embedded engine runs its own forward, so a server loads only a model's weights
(``areal_core/models/decoder_weights.py``) where it used to build the model with transformers. Three
ways, each in a fresh process, in turn within each repetition:

* ``imports only``: the server's module imported (torch, fastapi, the engine), no model;
* ``weights only``: that, then the model loaded as a server loads it now, and the engine built;
* ``transformers' model``: that, with the model built by transformers instead
  (``AutoModelForCausalLM.from_pretrained``).

Each process reports its own CPU seconds (user + system) when the engine is built; the parent
times its whole life. The tiny model and SmolLM2-135M, float32. The ratio is taken within a
repetition (transformers' model over weights only), so a host's drift cancels; median and range
over ``REPS`` repetitions. ``--quick``: one repetition of the tiny model, a smoke check.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from bench.common import REPO_ROOT, format_table

REPS = 5
WAYS = ("imports only", "weights only", "transformers' model")

PROBE = """
import json, resource, sys
import areal_core.rollout.backends.embedded.server  # noqa: F401 - what a server process imports
way, folder = sys.argv[1], sys.argv[2]
if way != "imports only":
    import torch
    from areal_core.rollout.backends.embedded.engine import RolloutEngine
    if way == "weights only":
        from areal_core.models.decoder_weights import load_served_model as load
    else:
        from areal_core.models.weights import load_model as load
    model = load(folder, torch.float32)
    RolloutEngine(model, start=False).shutdown()
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": u.ru_utime + u.ru_stime, "type": None if way == "imports only" else type(model).__name__}))
"""


def start_once(way: str, folder: str) -> dict:
    """One fresh process of ``way``: its CPU seconds, its wall time, the class of the model it loaded."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, way, folder], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    wall = time.perf_counter() - t0
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall}


def run(quick: bool) -> dict:
    from bench import models

    names, reps = (("tiny",), 1) if quick else (("tiny", "smollm2-135m"), REPS)
    rows, table, summary = [], [], {}
    for name in names:
        folder = models.model_folder(name)
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for rep in range(reps):
            for way in WAYS:
                runs[way].append(start_once(way, folder))
            print(f"  {name} repetition {rep + 1}/{reps}", flush=True)
        ratios = [t["cpu_s"] / w["cpu_s"] for t, w in zip(runs["transformers' model"], runs["weights only"])]
        summary[f"transformers_over_weights_only_cpu_{name.replace('-', '_')}"] = statistics.median(ratios)
        for way in WAYS:
            cpu = [x["cpu_s"] for x in runs[way]]
            wall = [x["wall_s"] for x in runs[way]]
            rows.append(
                {
                    "model": name,
                    "way": way,
                    "model_class": runs[way][0]["type"],
                    "cpu_s": cpu,
                    "wall_s": wall,
                    "cpu_over_weights_only": ratios if way == "transformers' model" else None,
                }
            )
            table.append(
                [
                    name,
                    way,
                    f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})",
                    f"{statistics.median(wall):.2f}",
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                    if way == "transformers' model"
                    else "",
                ]
            )
    print(format_table(["model", "way", "CPU s (range)", "wall s", "CPU over weights only"], table))
    return {"setup": {"repetitions": reps, "dtype": "float32"}, "rows": rows, "summary": summary}
