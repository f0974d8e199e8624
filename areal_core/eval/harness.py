"""Evaluate a checkpoint on benchmarks: serve it, sample k answers per problem, grade on Dask.

Generation goes through the rollout protocol (``RolloutPool``), so any server
that speaks it could be evaluated; here an embedded server is started on the
model. Grading runs as Dask tasks on the reward service, submitted as each
answer arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pandas as pd

from areal_core.data.prompting import decode_response, encode_prompt
from areal_core.data.records import Record
from areal_core.eval.benchmarks import Benchmark, get_benchmark, load_benchmark, reference_response, reference_text
from areal_core.eval.passk import maj_at_k, pass_at_k
from areal_core.models.config import model_context
from areal_core.reward.config import RewardConfig
from areal_core.reward.result import RewardResult
from areal_core.rollout.backend import Sampling
from areal_core.startup import entered_together, made_on_enter
from areal_core.storage.fsutil import write_json_atomic, write_parquet_atomic

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = {"math": 1024, "code": 1024, "chain": 64}
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.6, 0.95  # the public benchmarks'
SMOLLM2 = "smollm2-135m"
HELDOUT = "heldout"  # a training run's own held-out split, sampled as the run measured it


def run_folder_of(checkpoint: str) -> str | None:
    """``RUN`` for a local ``RUN/checkpoints/vN`` with ``RUN/config.json``, else None."""
    p = Path(checkpoint)
    if "://" in checkpoint or p.parent.name != "checkpoints" or not (p.parent.parent / "config.json").is_file():
        return None
    return str(p.parent.parent)


def run_heldout(run_dir: str) -> tuple[Benchmark, Sampling]:
    """The held-out problems the run in ``run_dir`` measured itself on (``eval.n_problems`` of its
    data's held-out split), and the sampling it used for them (greedy by default)."""
    from areal_core.data.datasets import load_records
    from areal_core.eval.heldout import heldout_sampling
    from areal_core.experiment import ExperimentConfig
    from areal_core.storage.fsutil import read_json

    cfg = ExperimentConfig.model_validate(read_json(os.path.join(run_dir, "config.json")))
    records = load_records(cfg.data)[1][: cfg.eval.n_problems]
    bench = Benchmark(
        HELDOUT,
        f"{cfg.name}'s held-out split ({len(records)} problems, the run's own settings)",
        records[0].task,
        lambda: records,
        None,
    )
    return bench, heldout_sampling(cfg)


def _cache_root() -> Path:
    return Path(os.environ.get("AREAL_FLOW_CACHE") or Path.home() / ".cache" / "areal-flow")


def check_model_arg(model: str) -> None:
    """A clear ValueError for a local ``model`` that cannot be what ``model_folder`` loads (URLs
    are checked when read)."""
    if model == SMOLLM2 or "://" in model:
        return
    p = Path(model)
    what = "give a checkpoint version folder (RUN/checkpoints/vN), an HF model folder, or smollm2-135m"
    if not p.exists():
        raise ValueError(f"{model}: no such file or folder ({what})")
    if (p / "config.json").is_file() or (p / "manifest.json").is_file():
        return
    versions = sorted(int(c.name[1:]) for c in p.iterdir() if re.fullmatch(r"v\d+", c.name) and c.is_dir())
    if versions:
        raise ValueError(
            f"{model} is a checkpoints folder: give one of its versions, e.g. {p / f'v{versions[-1]}'} "
            f"(the latest of {len(versions)})"
        )
    raise ValueError(f"{model} is neither a checkpoint version nor an HF model folder (no config.json; {what})")


def model_folder(model: str) -> str:
    """A folder (or URL) the rollout server can load: ``smollm2-135m`` is exported once to an HF folder;
    a checkpoint version (``.../v<N>`` with a manifest) comes through its store, which rebuilds a
    delta version into a full folder."""
    if model != SMOLLM2:
        return _checkpoint_folder(model) or model
    dest = _cache_root() / "smollm2-135m-hf"
    if (dest / "config.json").exists() and "quantization_config" not in json.loads((dest / "config.json").read_text()):
        return str(dest)  # (a folder written with the GGUF's quantization_config is written again)
    from areal_core.models.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()  # a plain HF model, so it can be saved
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():  # a stale folder: moved aside whole, then dropped
        stale = dest.with_name(f".{dest.name}.{os.getpid()}.stale")
        os.replace(dest, stale)
        shutil.rmtree(stale)
    os.replace(tmp, dest)  # readers never see a half-written folder
    return str(dest)


def _checkpoint_folder(url: str) -> str | None:
    from areal_core.storage import CheckpointStore
    from areal_core.storage.checkpoints import VersionNotFoundError

    m = re.match(r"^(.+?)/v(\d+)/?$", url)
    if m is None:
        return None
    store = CheckpointStore(m.group(1), cache_dir=str(_cache_root() / "checkpoints"))
    try:
        return store.local_copy(int(m.group(2)))
    except VersionNotFoundError:
        return None  # a folder named like a version, but not one: load it as it is


def load_tokenizer(folder_or_url: str):
    from areal_core.models.tokenizer import load_tokenizer as load_saved
    from areal_core.storage.localize import localize

    return load_saved(localize(folder_or_url), local_files_only=True)


class _Grades:
    """Collects reward-service verdicts delivered by ``on_done`` callbacks (from Dask threads)."""

    def __init__(self, n: int):
        self.results: list[RewardResult | None] = [None] * n
        self.errors: list[BaseException] = []
        self._arrived = threading.Semaphore(0)

    def submit(self, rewards, i: int, task: str, response: str, reference: str, tests: list[dict] | None) -> None:
        def on_done(result: RewardResult | None, error: BaseException | None) -> None:
            if error is not None:
                self.errors.append(error)
            self.results[i] = result
            self._arrived.release()

        rewards.submit(task, response, reference, on_done, tests=tests)

    def wait(self, progress: bool = False, desc: str = "") -> list[RewardResult]:
        from tqdm import tqdm

        for _ in tqdm(range(len(self.results)), desc=desc, disable=not progress, dynamic_ncols=True):
            self._arrived.acquire()
        if self.errors:
            raise RuntimeError(
                f"{len(self.errors)} grading task(s) failed; first: {self.errors[0]!r}"
            ) from self.errors[0]
        return self.results  # type: ignore[return-value]


async def _generate(
    urls: list[str], jobs: list[tuple[str, list[int], int, int]], sampling: Sampling, progress: bool, desc: str, on_done
) -> None:
    """Generate every job (rid, input_ids, seed, max_new_tokens) with ``sampling``, each with its own seed
    and max_new_tokens; ``on_done(index, response)`` as each finishes."""
    from tqdm import tqdm

    from areal_core.rollout.backends import default_client
    from areal_core.rollout.pool import RolloutPool

    pool = RolloutPool(urls, default_client, timeout_s=3600.0)
    bar = tqdm(total=len(jobs), desc=desc, unit="ans", disable=not progress, dynamic_ncols=True)

    async def one(i: int, rid: str, ids: list[int], seed: int, max_new: int) -> None:
        resp = await pool.generate(ids, dataclasses.replace(sampling, seed=seed, max_new_tokens=max_new), rid=rid)
        on_done(i, resp)
        bar.update(1)

    try:
        await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))
    finally:
        bar.close()
        await pool.aclose()


def _bench_summary(bench: Benchmark, df: pd.DataFrame, samples: int) -> dict:
    per_problem = df.sort_values(["problem_id", "sample"]).groupby("problem_id", sort=False)
    p1, pk, maj = [], [], []
    for _, g in per_problem:
        n, c = len(g), int(g["correct"].sum())
        p1.append(c / n)
        pk.append(pass_at_k(n, c, samples))
        if bench.task == "math":
            # pandas stores a missing parsed answer as NaN in a string column: no vote
            parsed = [a if isinstance(a, str) else None for a in g["parsed"]]
            maj.append(maj_at_k(parsed, [bool(c) for c in g["correct"]], samples))
    out = {
        "label": bench.label,
        "task": bench.task,
        "n_problems": len(p1),
        "samples": samples,
        "pass@1": sum(p1) / len(p1),
        f"pass@{samples}": sum(pk) / len(pk),
        "mean_length": float(df["n_tokens"].mean()),
        "truncated_share": float((df["finish_reason"] == "length").mean()),
        "no_room_share": float((df["finish_reason"] == "context").mean()),  # prompts that fill the context
    }
    if bench.task == "math":
        out[f"maj@{samples}"] = sum(maj) / len(maj)
    return out


def _evaluate_bench(
    bench: Benchmark,
    records: list[Record],
    urls,
    tokenizer,
    rewards,
    *,
    samples: int,
    sampling: Sampling,
    progress: bool,
    context: int | None = None,
) -> pd.DataFrame:
    """``context``: the model's positions. An answer gets at most what is left of it after its prompt; a
    prompt that leaves no room is not generated and graded wrong (``finish_reason`` ``context``)."""
    jobs, meta, skipped = [], [], []
    for pi, rec in enumerate(records):
        ids = encode_prompt(tokenizer, rec, bench.instruction)
        room = sampling.max_new_tokens if context is None else min(sampling.max_new_tokens, context - len(ids))
        for s in range(samples):
            if room < 1:
                skipped.append(
                    {
                        "problem_id": rec.id,
                        "sample": s,
                        "response": "",
                        "parsed": None,
                        "correct": False,
                        "reason": f"the prompt ({len(ids)} tokens) leaves no room in the model's context "
                        f"({context} positions)",
                        "n_tokens": 0,
                        "finish_reason": "context",
                    }
                )
                continue
            jobs.append((f"eval-{bench.name}-{pi}-{s}", ids, 1_000_003 * s + pi, room))
            meta.append((rec, s))
    if skipped:
        log.warning(
            "%s: %d of %d answers not generated: their prompts fill the model's context (%d positions)",
            bench.name,
            len(skipped),
            len(skipped) + len(jobs),
            context,
        )
    responses: list = [None] * len(jobs)
    grades = _Grades(len(jobs))

    def on_done(i: int, resp) -> None:  # submit grading at once: it overlaps generation
        rec = meta[i][0]
        text = decode_response(tokenizer, resp.output_ids)
        responses[i] = (text, resp)
        grades.submit(rewards, i, rec.task, text, reference_text(rec), rec.tests)

    asyncio.run(_generate(urls, jobs, sampling, progress, bench.name, on_done))
    results = grades.wait()
    rows = []
    for (rec, s), (text, resp), res in zip(meta, responses, results):
        rows.append(
            {
                "problem_id": rec.id,
                "sample": s,
                "response": text,
                "parsed": res.parsed,
                "correct": bool(res.correct),
                "reason": res.reason,
                "n_tokens": len(resp.output_ids),
                "finish_reason": resp.finish_reason,
            }
        )
    return pd.DataFrame(rows + skipped)


def _settings(samples: int, limit: int | None, temperature, top_p, max_new_tokens) -> dict:
    """An evaluation's options as its ``summary.json`` records them (and ``earlier_evaluation`` matches them)."""
    return {
        "samples": samples,
        "limit": limit,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
    }


def earlier_evaluation(
    out_dir: str,
    benches: list[str],
    *,
    samples: int = 1,
    limit: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
) -> dict | None:
    """The summary ``evaluate_checkpoint`` left in ``out_dir`` where it scored every one of ``benches``
    with these options (its own, with its defaults), else None: a campaign started again does not
    score its final checkpoints a second time."""
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    settings = _settings(samples, limit, temperature, top_p, max_new_tokens)
    done = summary.get("settings") == settings and set(benches) <= set(summary.get("benchmarks", {}))
    return summary if done and "wall_s" in summary else None  # wall_s: written once every bench was scored


def evaluate_checkpoint(
    model: str,
    benches: list[str],
    *,
    out_dir: str,
    samples: int = 1,
    limit: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    grading: RewardConfig | None = None,
    progress: bool = True,
    run_dir: str | None = None,
) -> dict:
    """Evaluate ``model`` on ``benches``; writes ``out_dir/<bench>/results.parquet`` and ``out_dir/summary.json``.

    ``model``: a checkpoint version folder or URL (``CheckpointStore``), an HF
    model folder, or ``smollm2-135m``. ``run_dir``: the training run the checkpoint belongs to
    (found by itself for a local ``RUN/checkpoints/vN``), whose held-out split and sampling the
    bench ``heldout`` uses. Sampling settings left None take each bench's own: the run's for
    ``heldout``, temperature 0.6 and top-p 0.95 for the others. ``grading``: where the answers are
    graded (its ``scheduler_address`` and ``tls_*`` files, as a run's ``reward`` section); None: a
    local Dask cluster. Returns the summary dict.
    """
    from areal_core.reward.service import RewardService
    from areal_core.rollout.backends.embedded.launcher import start_server

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    run_dir = run_dir or run_folder_of(model)
    own = {}
    if HELDOUT in benches:
        if run_dir is None:
            raise ValueError(
                f"bench '{HELDOUT}' is a training run's own held-out split: evaluate a run's checkpoint "
                f"(RUN/checkpoints/vN, with RUN/config.json) or give the run's folder"
            )
        own[HELDOUT] = run_heldout(run_dir)
    chosen = [own[b][0] if b in own else get_benchmark(b) for b in benches]  # unknown names fail before anything starts
    problems = {b.name: b.load()[:limit] if b.name in own else load_benchmark(b.name, limit) for b in chosen}
    check_model_arg(model)
    t0 = time.perf_counter()
    folder = model_folder(model)
    tokenizer = load_tokenizer(folder)
    context = model_context(folder)
    out = Path(out_dir)  # made once the model loads: a failed start leaves no empty folder
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "model": model,
        "run_dir": run_dir,
        "settings": _settings(samples, limit, temperature, top_p, max_new_tokens),
        "benchmarks": {},
    }
    with entered_together(
        made_on_enter(start_server, folder, log_path=str(out / "rollout_server.log"), max_running=512),
        made_on_enter(RewardService, grading or RewardConfig()),
    ) as (server, rewards):
        rewards.warm_up({bench.task for bench in chosen})
        for bench in chosen:
            tb = time.perf_counter()
            sampling = (
                own[bench.name][1]
                if bench.name in own
                else Sampling(
                    temperature=DEFAULT_TEMPERATURE,
                    top_p=DEFAULT_TOP_P,
                    max_new_tokens=DEFAULT_MAX_NEW_TOKENS[bench.task],
                )
            )
            given = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}  # None: not set
            sampling = dataclasses.replace(sampling, **{k: v for k, v in given.items() if v is not None})
            df = _evaluate_bench(
                bench,
                problems[bench.name],
                [server.url],
                tokenizer,
                rewards,
                samples=samples,
                sampling=sampling,
                progress=progress,
                context=context,
            )
            (out / bench.name).mkdir(exist_ok=True)
            write_parquet_atomic(df, out / bench.name / "results.parquet")
            summary["benchmarks"][bench.name] = {
                **_bench_summary(bench, df, samples),
                **{k: getattr(sampling, k) for k in given},
                "wall_s": time.perf_counter() - tb,
            }
            write_json_atomic(str(out / "summary.json"), summary)  # after each bench: partial results survive
    summary["wall_s"] = time.perf_counter() - t0
    write_json_atomic(str(out / "summary.json"), summary)
    return summary


def grading_config(reward: dict | None) -> RewardConfig | None:
    """Where an evaluation grades, from a run's ``reward`` settings (a dict: ``scheduler_address``, the
    ``tls_*`` files, ...); None: a local Dask cluster. A ValueError names a key that is wrong and why."""
    if reward is None:
        return None
    from pydantic import ValidationError

    try:
        return RewardConfig(**reward)
    except ValidationError as e:
        problems = "; ".join(
            (f"reward.{'.'.join(map(str, x['loc']))}: " if x["loc"] else "") + x["msg"].removeprefix("Value error, ")
            for x in e.errors()
        )
        raise ValueError(f"the grading settings: {problems}") from None


def reference_check(
    bench_name: str,
    *,
    limit: int | None = None,
    grading: RewardConfig | None = None,
    progress: bool = True,
) -> dict:
    """Grade every problem's own reference solution: a self-check of the data and the grader
    (``grading``: where, as :func:`evaluate_checkpoint`)."""
    from areal_core.reward.service import RewardService

    bench = get_benchmark(bench_name)
    records = load_benchmark(bench_name, limit)
    items, ids = [], []
    for rec in records:
        resp = reference_response(rec)
        if resp is not None:
            items.append((rec.task, resp, reference_text(rec), rec.tests))
            ids.append(rec.id)
    if not items:
        raise ValueError(f"{bench_name}: the data has no reference solutions to check")
    t0 = time.perf_counter()
    with RewardService(grading or RewardConfig(n_workers=2)) as rewards:  # (2 local workers: the checks are many)
        grades = _Grades(len(items))
        for i, (task, resp, ref, tests) in enumerate(items):
            grades.submit(rewards, i, task, resp, ref, tests)
        results = grades.wait(progress, f"{bench_name} reference")
    failures = [
        {"id": i, "parsed": (r.parsed or "")[:200], "reason": r.reason} for i, r in zip(ids, results) if not r.correct
    ]
    n_ok = len(results) - len(failures)
    return {
        "bench": bench_name,
        "label": bench.label,
        "n_problems": len(records),
        "n_with_reference": len(items),
        "n_correct": n_ok,
        "accuracy": n_ok / len(items),
        "wall_s": time.perf_counter() - t0,
        "failures": failures,
    }
