"""Reward throughput: math and code grading per second on 1 vs 2 Dask workers (code with functional
tests also a group of answers per Dask task, one sandbox run per group, as training grades them), and,
given another checkout of the code, the same measured on it in the same run, side by side.

The graders are the system's (``areal_core.reward.dispatch.grade``: math through
``grade_math_result``, code through ``grade_code`` in its sandbox). A Dask LocalCluster
(processes, 1 thread each, as ``RewardService`` starts it) grades a fixed set of
responses, half right and half wrong; throughput = responses / wall time of
``client.map`` + ``gather``, after one warm-up pass that imports the graders in
every worker.

``AREAL_BENCH_BEFORE=DIR python -m bench rewards`` (DIR: a checkout of the code to compare with, e.g.
``git worktree add DIR COMMIT``) measures DIR's graders too, in a process of its own that
imports ``areal_core`` from DIR, alternating with this checkout's repetition by repetition, each first in
every other one (4 repetitions, so that what else the machine does falls on both alike), and prints this
checkout's rate over DIR's per row.

This file also runs as a script (``python bench/rewards.py --measure [--quick]``: one repetition, JSON on
stdout), importing nothing from ``bench``, so that it measures whichever ``areal_core`` is on the path.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time

GROUP = 8  # answers per prompt: what the trainer sends to grading together
WORKERS = (1, 2)


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


def assert_items(n: int, rng: random.Random) -> list[tuple[str, str, list[dict]]]:
    """HumanEval's shape: a prefix with the stub, a check(candidate) of four asserts, run by the checker."""
    items = []
    for i in range(n):
        a = rng.randint(2, 9)
        prefix = f'def scale(xs):\n    """Each of xs times {a}."""\n'
        body = f"def scale(xs):\n    return [x * {a if i % 2 == 0 else a + 1} for x in xs]\n"
        code = "def check(candidate):\n" + "".join(
            f"    assert candidate({xs}) == {[x * a for x in xs]}\n" for xs in ([], [1], [2, 3], [-1, 0, 5])
        )
        test = {"testtype": "assert", "code": code + "\n\ncheck(scale)\n", "prefix": prefix, "entry_point": "scale"}
        items.append((f"```python\n{body}```\n", "", [test]))
    return items


def item_sets(quick: bool) -> dict[str, list]:
    rng = random.Random(0)
    n_math, n_code = (40, 12) if quick else (400, 80)
    functional = functional_items(n_code, rng)
    return {
        "math": math_items(n_math, rng),
        "code (stdin, 3 tests)": code_items(n_code, rng),
        "functional, one per task": functional,
        f"functional, groups of {GROUP}": functional,
        "assert (checker)": assert_items(n_code, rng),
    }


def _rate(client, task: str, items: list, grouped: bool) -> tuple[float, int]:
    from areal_core.reward.dispatch import grade, grade_batch

    t0 = time.perf_counter()
    if grouped:  # a group's answers in one Dask task (the training path: one sandbox run for a group)
        groups = [[(task, *x) for x in items[k : k + GROUP]] for k in range(0, len(items), GROUP)]
        futs = client.map(grade_batch, groups, [30.0] * len(groups), pure=False)
        results = [r for rs in client.gather(futs) for r in rs]
    else:
        cols = list(zip(*items))
        futs = client.map(grade, [task] * len(items), *cols, pure=False)
        results = client.gather(futs)
    return len(items) / (time.perf_counter() - t0), sum(bool(r.correct) for r in results)


def measure(quick: bool) -> dict:
    """One repetition of every row on 1 and 2 workers: ``{row: {"rates": {workers: grades/s}, "right": n}}``."""
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.ERROR)
    sets = item_sets(quick)
    out = {name: {"rates": {}, "right": 0, "n": len(items)} for name, items in sets.items()}
    for workers in WORKERS:
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
            for name, items in sets.items():
                task = "math" if name == "math" else "code"
                _rate(client, task, items[: 2 * workers + 2], grouped=False)  # warm-up: graders imported everywhere
                rate, right = _rate(client, task, items, grouped=name.startswith("functional, groups"))
                out[name]["rates"][str(workers)] = rate
                out[name]["right"] = right
    return out


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


def _measure_in(checkout: str, quick: bool) -> dict:
    """One repetition of :func:`measure` in a process of its own that imports the ``areal_core`` of
    ``checkout`` (this one's measured the same way as the other, for a fair comparison)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {checkout} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(reps: dict[str, list[dict]]) -> list[tuple]:
    from bench.common import median, ratio

    rows = []
    after = reps["after"]
    for name in after[0]:
        for w in map(str, WORKERS):
            now = median([r[name]["rates"][w] for r in after])
            was = median([r[name]["rates"][w] for r in reps["before"]]) if reps.get("before") else None
            rows.append((name, w, after[0][name]["n"], was, now, ratio(now, was), after[0][name]["right"]))
    return rows


def run(quick: bool) -> dict:
    from bench.common import format_table, median, progress, ratio

    before = os.environ.get("AREAL_BENCH_BEFORE")
    n_reps = 1 if quick else (4 if before else 3)  # with a checkout to compare: each goes first as often
    reps: dict[str, list[dict]] = {"after": [], **({"before": []} if before else {})}
    for k in progress(range(n_reps), desc="rewards"):
        order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
        for which in order if before else ["after"]:
            reps[which].append(_measure_in(before if which == "before" else HERE, quick))
    rows = _rows(reps)
    print(
        format_table(
            ["task", "workers", "responses", "before /s", "after /s", "after over before", "graded right"],
            rows,
            title=f"grading throughput (Dask LocalCluster, 1 thread per worker; before: {before or 'not measured'})",
        )
    )
    rate = {(name, w): now for name, w, _, _, now, _, _ in rows}
    return {
        "setup": {
            "repetitions": n_reps,
            "before": before,
            "rows": {name: r["n"] for name, r in reps["after"][0].items()},
            "grader": "areal_core.reward.dispatch.grade; groups: grade_batch (one sandbox run per group)",
        },
        "repetitions": reps,
        "rows": [dict(zip(("task", "workers", "responses", "before", "after", "ratio", "right"), r)) for r in rows],
        "summary": {
            "math_grades_per_s_1w": rate[("math", "1")],
            "math_grades_per_s_2w": rate[("math", "2")],
            "code_grades_per_s_1w": rate[("code (stdin, 3 tests)", "1")],
            "code_grades_per_s_2w": rate[("code (stdin, 3 tests)", "2")],
            "functional_grades_per_s_1w": rate[("functional, one per task", "1")],
            "functional_grouped_grades_per_s_1w": rate[(f"functional, groups of {GROUP}", "1")],
            "functional_grouped_over_single_1w": ratio(
                rate[(f"functional, groups of {GROUP}", "1")], rate[("functional, one per task", "1")]
            ),
            "reward_2w_over_1w_math": ratio(rate[("math", "2")], rate[("math", "1")]),
            "reward_2w_over_1w_code": ratio(rate[("code (stdin, 3 tests)", "2")], rate[("code (stdin, 3 tests)", "1")]),
            "after_over_before_min": min((r[5] for r in rows if r[5] is not None), default=None),
            "after_over_before_median": median([r[5] for r in rows if r[5] is not None]) if before else None,
        },
    }


if __name__ == "__main__" and "--measure" in sys.argv:
    print(json.dumps(measure("--quick" in sys.argv)))
