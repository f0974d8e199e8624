"""The local stack for real: Prefect server (SQLite) + process worker on 127.0.0.1, `prefect deploy`
of prefect.yaml, a sweep deployment run, and the evaluate deployment triggered by that run's
checkpoint events. Stopping the stack leaves no process behind."""

import asyncio
import json
from pathlib import Path

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate

from infra.stack import Stack, free_port
from tests.prefect_api import DEPLOYMENTS, prefect_api, wait_for

pytestmark = pytest.mark.nightly  # the whole Prefect stack: make test-nightly (CI runs it)

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "tests/data/campaign_tiny.yaml")
EXPECTED_DEPLOYMENTS = DEPLOYMENTS


async def _deployments():
    async with get_client() as c:
        deps = await c.read_deployments()
        flows = {f.id: f.name for f in await c.read_flows()}
        return {d.name: (flows[d.flow_id], d) for d in deps}


async def _limit_evaluations(dep_id):
    # every triggered evaluation uses 8 problems (the automation's parameters are merged over these)
    async with get_client() as c:
        await c.update_deployment(dep_id, DeploymentUpdate(parameters={"benches": ["synthetic"], "limit": 8}))


async def _start(name: str, parameters: dict):
    async with get_client() as c:
        dep = await c.read_deployment_by_name(name)
        return (await c.create_flow_run_from_deployment(dep.id, parameters=parameters)).id


async def _flow_run(run_id):
    async with get_client() as c:
        return await c.read_flow_run(run_id)


async def _runs_of(deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async with get_client() as c:
        return await c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


@pytest.mark.slow
def test_stack_sweep_deployment_triggers_evaluations(tmp_path):
    stack = Stack(home=tmp_path / "stack", port=free_port(), query_seconds=1)
    out = tmp_path / "sweep"
    pids: list[int] = []
    try:
        state = stack.up(log=print)
        assert state["ui_url"].startswith("http://127.0.0.1:")
        with prefect_api(state["api_url"]):
            deps = asyncio.run(_deployments())
            assert set(deps) >= EXPECTED_DEPLOYMENTS
            campaign = deps["campaign"][1]
            assert campaign.schedules and campaign.paused  # shipped paused: the UI shows it so
            assert all(d.description for _, d in deps.values()), [n for n, (_, d) in deps.items() if not d.description]
            asyncio.run(_limit_evaluations(deps["evaluate"][1].id))

            run_id = asyncio.run(
                _start(
                    "sweep/sweep",
                    {
                        "config_path": CONFIG,
                        "eta": [1],
                        "objective": ["decoupled"],
                        "max_steps": 2,
                        "out_dir": str(out),
                        "evaluate_every": 1,
                        "cache_dir": str(tmp_path / "cache"),
                    },
                )
            )
            sweep_run = wait_for(
                lambda: (r := asyncio.run(_flow_run(run_id))).state.is_final() and r, 240, "the sweep flow run"
            )
            assert sweep_run.state.is_completed(), sweep_run.state
            run_dir = out / "eta1-decoupled"
            assert json.loads((run_dir / "summary.json").read_text())["final_version"] == 2
            assert (out / "report.csv").exists()

            # v1 and v2 were marked for evaluation: the automation started one evaluate run for each
            expected = {str(run_dir / "checkpoints/v1"), str(run_dir / "checkpoints/v2")}

            def triggered():
                runs = asyncio.run(_runs_of(deps["evaluate"][1].id))
                done = [r for r in runs if r.state.is_final()]
                return runs if len(runs) >= 2 and len(done) == len(runs) else None

            pids = stack.pids()
            runs = wait_for(triggered, 180, "the triggered evaluate flow runs")
            assert {r.parameters["checkpoint_url"] for r in runs} == expected
            assert all(r.state.is_completed() for r in runs), [(r.name, r.state) for r in runs]
            for r in runs:
                version = int(r.parameters["version"])
                assert r.parameters["out_dir"] == str(run_dir / f"evals/v{version}")
                ev = json.loads((run_dir / f"evals/v{version}/summary.json").read_text())
                assert ev["benchmarks"]["synthetic"]["n_problems"] == 8
        pids = sorted(set(pids) | set(stack.pids()))
        assert len(pids) >= 2  # server and worker at least
    finally:
        stack.down(log=print)
    assert stack.state() is None
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {left}"
