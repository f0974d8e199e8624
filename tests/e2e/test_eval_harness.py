"""The evaluation harness: a real run through a rollout server and the Dask reward service, and its metrics."""

import itertools
import json
from pathlib import Path

import pandas as pd
import pytest

from areal_core.data.prompting import encode_prompt
from areal_core.data.synthetic import grade_chain
from areal_core.eval.benchmarks import get_benchmark, load_benchmark
from areal_core.eval.harness import _bench_summary, evaluate_checkpoint
from areal_core.models.config import TinyArch
from areal_core.models.tiny import build_tiny
from areal_core.models.tokenizer import build_char_tokenizer
from areal_core.storage import CheckpointStore

SMALL = TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def subsets_reference(outcomes: list[bool], k: int) -> float:
    """pass@k by enumerating every k-subset of one problem's samples."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_summary_metrics_match_enumeration_of_subsets():
    rng = __import__("random").Random(3)
    rows = []
    for p in range(7):
        for s in range(5):
            ok = rng.random() < p / 7
            wrong = None if s == 4 else str(s % 2 + 2)  # None: no answer found (stored as NaN by pandas)
            rows.append(
                {
                    "problem_id": f"p{p}",
                    "sample": s,
                    "correct": ok,
                    "parsed": "1" if ok else wrong,
                    "n_tokens": 10 + s,
                    "finish_reason": "stop",
                }
            )
    df = pd.DataFrame(rows)
    got = _bench_summary(get_benchmark("gsm8k"), df, samples=5)
    by_problem = [list(g.sort_values("sample")["correct"]) for _, g in df.groupby("problem_id")]
    assert got["n_problems"] == 7 and got["samples"] == 5
    assert got["pass@1"] == pytest.approx(sum(subsets_reference(o, 1) for o in by_problem) / 7)
    assert got["pass@5"] == pytest.approx(sum(subsets_reference(o, 5) for o in by_problem) / 7)
    assert 0 < got["pass@1"] < got["pass@5"] < 1  # the draw above is mixed, so the check is not trivial
    assert got["mean_length"] == pytest.approx(12.0)
    majority = []
    for _, g in df.groupby("problem_id"):
        votes = [a for a in g.sort_values("sample")["parsed"] if isinstance(a, str)]
        top = max(votes, key=lambda a: (votes.count(a), -votes.index(a))) if votes else None
        majority.append(top == "1")
    assert got["maj@5"] == pytest.approx(sum(majority) / 7)


@pytest.mark.slow
def test_real_run_on_a_tiny_checkpoint(tmp_path, shared_grading):
    tok = build_char_tokenizer()
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    url = store.publish(0, build_tiny(SMALL, tok, seed=0), tok)
    out = tmp_path / "eval"
    summary = evaluate_checkpoint(
        url,
        ["synthetic"],
        out_dir=str(out),
        samples=3,
        limit=6,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=24,
        grading=shared_grading,
        progress=False,
    )
    assert json.loads((out / "summary.json").read_text()) == summary
    bench = summary["benchmarks"]["synthetic"]
    assert bench["n_problems"] == 6 and bench["samples"] == 3
    df = pd.read_parquet(out / "synthetic" / "results.parquet")
    assert len(df) == 18 and set(df["sample"]) == {0, 1, 2}
    assert set(df.columns) >= {"problem_id", "sample", "response", "parsed", "correct", "reason", "n_tokens"}
    assert (df["n_tokens"] >= 1).all() and (df["n_tokens"] <= 24).all()
    # the Dask verdicts agree with grading the stored responses directly
    refs = {r.id: r.solution for r in load_benchmark("synthetic", 6)}
    for row in df.itertuples():
        assert bool(row.correct) == grade_chain(row.response, refs[row.problem_id])[0]
    # the summary agrees with pass@k computed by enumeration from the per-sample results
    outcomes = [list(g.sort_values("sample")["correct"]) for _, g in df.groupby("problem_id")]
    for k in (1, 3):
        key = f"pass@{k}"
        assert bench[key] == pytest.approx(sum(subsets_reference(o, k) for o in outcomes) / len(outcomes))
    assert bench["mean_length"] == pytest.approx(df["n_tokens"].mean())


@pytest.mark.slow
def test_answers_fit_the_model_context_and_prompts_that_fill_it_are_graded_wrong(tmp_path, shared_grading):
    """A 96-position model on HumanEval (prompts of hundreds of characters) and on chain sums asked for 1024 new
    tokens: the HumanEval answers are not generated (graded wrong, named), the chain answers are cut to the
    room their prompt leaves, and the evaluation completes."""
    tok = build_char_tokenizer()
    arch = SMALL.model_copy(update={"max_position_embeddings": 96})
    url = CheckpointStore(f"file://{tmp_path}/ckpt").publish(0, build_tiny(arch, tok, seed=0), tok)
    summary = evaluate_checkpoint(
        url,
        ["humaneval", "synthetic"],
        out_dir=str(tmp_path / "eval"),
        limit=3,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=1024,
        grading=shared_grading,
        progress=False,
    )
    he = pd.read_parquet(tmp_path / "eval" / "humaneval" / "results.parquet")
    assert len(he) == 3 and not he["correct"].any() and (he["finish_reason"] == "context").all()
    assert he["reason"].str.contains("leaves no room in the model's context \\(96 positions\\)").all()
    assert summary["benchmarks"]["humaneval"]["no_room_share"] == 1.0
    syn = pd.read_parquet(tmp_path / "eval" / "synthetic" / "results.parquet")
    bench = get_benchmark("synthetic")
    prompts = {r.id: len(encode_prompt(tok, r, bench.instruction)) for r in load_benchmark("synthetic", 3)}
    assert (syn["finish_reason"] != "context").all()
    assert all(row.n_tokens <= 96 - prompts[row.problem_id] for row in syn.itertuples())
    assert (syn["finish_reason"] == "length").any()  # the room, not the 1024 asked for, ended some answers


def test_unknown_benchmark_fails_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate_checkpoint("smollm2-135m", ["nope"], out_dir=str(tmp_path))
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_heldout_of_a_run_agrees_with_what_the_run_reported(tmp_path, warm_cache, shared_rewards, shared_grading):
    """Evaluating a run's final checkpoint without further settings scores the run's own held-out
    problems with its own sampling: the number `train` printed, problem for problem."""
    from areal_core.experiment import load_config
    from areal_core.run.setup import run_experiment

    cfg = load_config(Path(__file__).resolve().parents[1] / "data/campaign_tiny.yaml", shared_rewards)
    run = tmp_path / "run"
    s = run_experiment(cfg, run, progress=False, cache_dir=warm_cache)
    ckpt = str(run / "checkpoints" / f"v{s['final_version']}")
    summary = evaluate_checkpoint(
        ckpt, ["heldout"], out_dir=str(tmp_path / "eval"), grading=shared_grading, progress=False
    )
    got = summary["benchmarks"]["heldout"]
    assert summary["run_dir"] == str(run)
    assert got["n_problems"] == s["n_eval_problems"] == 8
    assert (got["temperature"], got["top_p"], got["max_new_tokens"]) == (0.0, 1.0, 24)  # the run's, not 0.6/0.95/64
    assert got["pass@1"] == pytest.approx(s["accuracy_after"])
    # without a run to take them from, heldout fails before anything starts
    with pytest.raises(ValueError, match=r"heldout.*training run"):
        evaluate_checkpoint(str(tmp_path / "elsewhere"), ["heldout"], out_dir=str(tmp_path / "e2"))


def test_evaluation_names_and_keys_are_per_run_and_version():
    from tasks.evaluation import evaluation_key, evaluation_name

    assert evaluation_name("/x/runs/eta1-decoupled/checkpoints/v3") == "evaluate-eta1-decoupled-v3"
    assert evaluation_name("s3://b/store/v12", "/x/runs/quick_start") == "evaluate-quick_start-v12"
    assert evaluation_key("s3://b/store/v12", "/x/runs/quick_start") == "evaluation-quick-start-v12"
    assert evaluation_key("/a/r1/checkpoints/v2") != evaluation_key("/a/r2/checkpoints/v2")
