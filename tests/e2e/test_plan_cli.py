"""`areal-flow plan` (the planner's CLI) and the `plan` Prefect flow: the table, the files,
the answer lengths of a past run, and one `error:` line for each kind of bad input."""

import json

import pandas as pd
import pytest

from flows.cli import main

# 1.5B on 8 H800s with short answers: a few seconds for the whole plan
SMALL = [
    "plan",
    "--model",
    "1.5B",
    "--gpus",
    "8",
    "--context",
    "2048",
    "--prompt-tokens",
    "128",
    "--answer-median",
    "300",
    "--answer-sigma",
    "1.0",
    "--prompts-per-step",
    "8",
    "--answers-per-prompt",
    "4",
    "--eta",
    "1,4",
    "--ratio",
    "1:1,3:1",
    "--steps",
    "9",
]


def test_plan_prints_the_alternatives_and_writes_json_and_plot(tmp_path, capsys):
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| alternative | tokens/s | vs sync |" in out and "**Recommended: " in out
    data = json.loads((tmp_path / "plan.json").read_text())
    alts = data["alternatives"]
    assert len(alts) == 1 + 2 * 2  # sync + 2 splits x 2 etas
    assert [a["throughput"] for a in alts] == sorted((a["throughput"] for a in alts), reverse=True)
    assert {(a["n_rollout_gpus"], a["n_trainer_gpus"]) for a in alts if a["mode"] == "async"} == {(4, 4), (6, 2)}
    assert data["recommended"]["label"] in out
    assert (tmp_path / "plan_ratio.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_takes_answer_lengths_from_a_past_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"n_tokens": [40, 60, 80, 500] * 25}).to_parquet(run / "ledger.parquet")
    assert main(SMALL + ["--from-run", str(run), "--out", str(tmp_path / "plan")]) == 0
    data = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert data["request"]["answers"].startswith(f"100 trained answers of {run}")

    only_metrics = tmp_path / "run2"  # no ledger: a lognormal through the per-step percentiles
    only_metrics.mkdir()
    pd.DataFrame({"answer_len_p50": [50.0, 60.0], "answer_len_p90": [200.0, 220.0]}).to_parquet(
        only_metrics / "metrics.parquet"
    )
    assert main(SMALL + ["--from-run", str(only_metrics)]) == 0
    assert "lognormal through" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ratio", "1:0"], "error: ratio: 1:0 leaves no trainer device"),
        (["--ratio", "15:1"], "error: ratio: 15:1 leaves no trainer device of 8 GPUs"),
        (["--ratio", "three"], "error: ratio: expected ROLLOUT:TRAINER"),
        (["--lengths", "100,-3,50"], "error: lengths.samples: lengths must be >= 0"),
        (["--answer-median", "-5"], "error: lengths.median must be > 0"),
        (
            ["--model", "32B", "--gpus", "4", "--ratio", "1:1"],
            "error: n_gpus: model 32B does not fit 4 x H800 for training",
        ),
        (
            ["--model", "32B", "--context", "2000000"],
            "error: model: model 32B does not fit a rollout server of 8 x H800",
        ),
        (["--gpu-type", "B300"], "error: gpu: unknown GPU type 'B300'"),
        (["--model", "70B"], "error: model: unknown model '70B'"),
        (["--gpus", "0"], "error: n_gpus: must be at least 1"),
        (["--context", "100"], "error: context: 100 leaves no room to answer"),
        (["--eta", "1,x"], "error: --eta expects comma-separated whole numbers"),
        (["--from-run", "/nonexistent/run"], "error: from_run: /nonexistent/run holds neither"),
    ],
)
def test_bad_input_is_one_error_line(args, message, capsys):
    assert main(SMALL + args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_weight_update_takes_only_the_modes(capsys):
    with pytest.raises(SystemExit) as e:
        main(SMALL + ["--weight-update", "hot"])
    assert e.value.code == 2
    assert "invalid choice: 'hot' (choose from 'reprefill', 'keep_kv', 'drain')" in capsys.readouterr().err


def test_model_names_carrying_a_size():
    from areal_core.sim.request import model_preset

    assert model_preset("DeepSeek-R1-Distill-Qwen-7B").name == "7B"
    assert model_preset("qwen2.5-1.5b-instruct").name == "1.5B"
    assert model_preset("32b").name == "32B"


@pytest.mark.slow
def test_plan_flow_publishes_table_and_plot_artifacts(tmp_path, prefect_harness):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.plan import plan

    async def artifacts():  # (the test server is shared with other tests: only the plan's keys)
        async with get_client() as c:
            keys = ArtifactFilter(key=ArtifactFilterKey(any_=["plan", "plan-alternatives"]))
            return {a.key: a for a in await c.read_artifacts(artifact_filter=keys, limit=50)}

    out = plan(
        model="1.5B",
        n_gpus=8,
        context=2048,
        prompt_tokens=128,
        answer_median=300.0,
        etas=[2],
        ratios=["3:1"],
        prompts_per_step=8,
        answers_per_prompt=4,
        n_steps=9,
        out_dir=str(tmp_path),
    )
    found = asyncio.run(artifacts())
    assert out["recommended"]["label"] and (tmp_path / "plan_ratio.png").is_file()
    assert found["plan-alternatives"].type == "table"
    assert "data:image/png;base64," in found["plan"].data and "Recommended" in found["plan"].data
