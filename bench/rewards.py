"""Reward throughput: math and code grading per second on 1 vs 2 Dask workers (code with functional
tests also a group of answers per Dask task, one sandbox run per group, as training grades them).

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


def functional_items(n: int, rng: random.Random) -> list[tuple[str, str, list[dict]]]:
    """The code quickstart's shape: a small function, six functional tests (values compared on the host)."""
    items = []
    for i in range(n):
        a, c = rng.randint(-9, 9), rng.randint(-20, 20)
        body = f"def f(x, y):\n    return {a} * x + y + {c if i % 2 == 0 else c + 1}\n"
        tests = [
            {"testtype": "functional", "input": f"{x}\n{y}", "output": str(a * x + y + c), "fn_name": "f"}
            for x, y in ((0, 0), (1, 0), (0, 1), (2, 3), (-1, 4), (5, -2))
        ]
        items.append((f"```python\n{body}```\n", "", tests))
    return items


GROUP = 8  # answers per prompt: what the trainer sends to grading together


def _rate(client, items, grouped: bool = False) -> tuple[float, int]:
    from areal_core.reward.dispatch import grade, grade_batch

    task = "code" if items[0][2] else "math"
    with Timer() as t:
        if grouped:  # a group's answers in one Dask task (the training path: one sandbox run for a group)
            groups = [[(task, *x) for x in items[k : k + GROUP]] for k in range(0, len(items), GROUP)]
            results = [
                r for rs in client.gather(client.map(grade_batch, groups, [30.0] * len(groups), pure=False)) for r in rs
            ]
        else:
            futs = client.map(
                grade,
                [task] * len(items),
                [x[0] for x in items],
                [x[1] for x in items],
                [x[2] for x in items],
                pure=False,
            )
            results = client.gather(futs)
    return len(items) / t.s, sum(bool(r.correct) for r in results)


def run(quick: bool) -> dict:
    from distributed import Client, LocalCluster

    rng = random.Random(0)
    n_math, n_code = (40, 12) if quick else (400, 80)
    reps = 1 if quick else 3
    sets = {
        "math": math_items(n_math, rng),
        "code": code_items(n_code, rng),
        "functional": functional_items(n_code, rng),
        f"functional, groups of {GROUP}": None,
    }
    sets[f"functional, groups of {GROUP}"] = sets["functional"]
    logging.getLogger("distributed").setLevel(logging.ERROR)
    res: dict[str, dict[int, list[float]]] = {k: {1: [], 2: []} for k in sets}
    correct: dict[str, int] = {}
    for workers in (1, 2):
        with (
            LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                worker_dashboard_address=None,
                silence_logs=logging.ERROR,
            ) as cluster,
            Client(cluster) as client,
        ):
            for task, items in sets.items():
                _rate(client, items[: 2 * workers + 2])  # warm-up: graders imported in every worker
                for _ in progress(range(reps), desc=f"rewards {task} x{workers}"):
                    rate, ok = _rate(client, items, grouped=task.endswith(f"groups of {GROUP}"))
                    res[task][workers].append(rate)
                    correct[task] = ok
    rows = [
        (
            task,
            len(sets[task]),
            median(res[task][1]),
            median(res[task][2]),
            ratio(median(res[task][2]), median(res[task][1])),
            correct[task],
        )
        for task in sets
    ]
    print(
        format_table(
            ["task", "responses", "1 worker /s", "2 workers /s", "2 over 1", "graded right"],
            rows,
            title="grading throughput (Dask LocalCluster, 1 thread per worker, 2-core machine)",
        )
    )
    return {
        "setup": {
            "math_responses": n_math,
            "code_responses": n_code,
            "repetitions": reps,
            "code_tests_per_problem": 3,
            "functional_tests_per_problem": 6,
            "grader": "areal_core.reward.dispatch.grade; groups: grade_batch (one sandbox run per group)",
        },
        "rates_per_s": {t: {str(w): xs for w, xs in d.items()} for t, d in res.items()},
        "summary": {
            "math_grades_per_s_1w": median(res["math"][1]),
            "math_grades_per_s_2w": median(res["math"][2]),
            "code_grades_per_s_1w": median(res["code"][1]),
            "code_grades_per_s_2w": median(res["code"][2]),
            "reward_2w_over_1w_math": ratio(median(res["math"][2]), median(res["math"][1])),
            "reward_2w_over_1w_code": ratio(median(res["code"][2]), median(res["code"][1])),
            "functional_grades_per_s_1w": median(res["functional"][1]),
            "functional_grouped_grades_per_s_1w": median(res[f"functional, groups of {GROUP}"][1]),
            "functional_grouped_over_single_1w": ratio(
                median(res[f"functional, groups of {GROUP}"][1]), median(res["functional"][1])
            ),
        },
    }
