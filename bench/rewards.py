"""Reward throughput: math and code grading per second on 1 vs 2 Dask workers.

The graders are the system's (``areal_core.reward.dispatch.grade``: math through
``grade_math_result``, code through ``grade_code`` in its sandbox). A Dask LocalCluster
(processes, 1 thread each, as ``RewardService`` starts it) grades a fixed set of
responses, half right and half wrong; throughput = responses / wall time of
``client.map`` + ``gather``, after one warm-up pass that imports the graders in
every worker.
"""

from __future__ import annotations

import logging
import random

from bench.common import Timer, format_table, median, progress, ratio


def math_items(n: int, rng: random.Random) -> list[tuple[str, str, None]]:
    items = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        forms = [str(a * b), f"{a * b}.0", f"\\frac{{{2 * a * b}}}{{2}}", str(a * b + 1)]
        ans = forms[i % len(forms)]
        items.append((f"We multiply {a} by {b}. The answer is \\boxed{{{ans}}}.", str(a * b), None))
    return items


def code_items(n: int, rng: random.Random) -> list[tuple[str, str, list[dict]]]:
    items = []
    for i in range(n):
        k = rng.randint(1, 9)
        body = f"print(sum(int(x) for x in input().split()) + {k if i % 2 == 0 else k + 1})"
        tests = [{"testtype": "stdin", "input": f"{a} {a + 1}\n", "output": f"{2 * a + 1 + k}\n"} for a in range(3)]
        items.append((f"Here is my solution:\n```python\n{body}\n```\n", "", tests))
    return items


def _rate(client, items) -> tuple[float, int]:
    from areal_core.reward.dispatch import grade

    task = "code" if items[0][2] else "math"
    with Timer() as t:
        futs = client.map(grade, [task] * len(items), [x[0] for x in items], [x[1] for x in items],
                          [x[2] for x in items], pure=False)
        results = client.gather(futs)
    return len(items) / t.s, sum(bool(r.correct) for r in results)


def run(quick: bool) -> dict:
    from distributed import Client, LocalCluster

    rng = random.Random(0)
    n_math, n_code = (40, 12) if quick else (400, 80)
    reps = 1 if quick else 3
    sets = {"math": math_items(n_math, rng), "code": code_items(n_code, rng)}
    logging.getLogger("distributed").setLevel(logging.ERROR)
    res: dict[str, dict[int, list[float]]] = {k: {1: [], 2: []} for k in sets}
    correct: dict[str, int] = {}
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, worker_dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            for task, items in sets.items():
                _rate(client, items[: 2 * workers + 2])  # warm-up: graders imported in every worker
                for _ in progress(range(reps), desc=f"rewards {task} x{workers}"):
                    rate, ok = _rate(client, items)
                    res[task][workers].append(rate)
                    correct[task] = ok
    rows = [(task, len(sets[task]), median(res[task][1]), median(res[task][2]),
             ratio(median(res[task][2]), median(res[task][1])), correct[task]) for task in sets]
    print(format_table(["task", "responses", "1 worker /s", "2 workers /s", "2 over 1", "graded right"], rows,
                       title="grading throughput (Dask LocalCluster, 1 thread per worker, 2-core machine)"))
    return {
        "setup": {"math_responses": n_math, "code_responses": n_code, "repetitions": reps,
                  "code_tests_per_problem": 3, "grader": "areal_core.reward.dispatch.grade"},
        "rates_per_s": {t: {str(w): xs for w, xs in d.items()} for t, d in res.items()},
        "summary": {
            "math_grades_per_s_1w": median(res["math"][1]), "math_grades_per_s_2w": median(res["math"][2]),
            "code_grades_per_s_1w": median(res["code"][1]), "code_grades_per_s_2w": median(res["code"][2]),
            "reward_2w_over_1w_math": ratio(median(res["math"][2]), median(res["math"][1])),
            "reward_2w_over_1w_code": ratio(median(res["code"][2]), median(res["code"][1])),
        },
    }
