"""The `train` deployment as a user meets it: a real stack (server, worker, prefect.yaml deployed), runs
started from the deployment with the form's defaults, and the UI they produce, in a headless browser.

* Two runs with the form's defaults both complete, each in a folder of its own; the first run's
  files are byte for byte the same after the second. A run told to use the first one's folder is
  refused before it writes anything, with one line that says what to set, and no traceback.
* The run's name says what it runs (config and seed); its Artifacts tab holds its learning curves as
  an image the browser has loaded, and its result as a table of rounded numbers whose evaluation link
  opens the evaluation itself.

The config is the tests' tiny one (a run of the quickstart takes minutes); every other parameter is
left as the form has it. The browser is Debian's chromium (or chromium-headless-shell): without one
the UI test is skipped with the reason (AREAL_REQUIRE_BROWSER=1 makes it fail).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from infra.stack import Stack, free_port
from tests.prefect_api import prefect_api, wait_for

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "tests/data/campaign_tiny.yaml")
# the stack, three runs and an evaluation, each its own process: 4-6 min, over 10 on a busy machine
pytestmark = [pytest.mark.timeout(1800), pytest.mark.nightly]


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _run(deployment: str, parameters: dict, timeout_s: float = 600):
    c = _client()
    dep = c.read_deployment_by_name(deployment)
    run_id = c.create_flow_run_from_deployment(dep.id, parameters=parameters).id
    return wait_for(lambda: (r := c.read_flow_run(run_id)).state.is_final() and r, timeout_s, f"a {deployment} run")


def _evaluation_of(run_dir: Path, timeout_s: float = 600):
    """The evaluate run the automation started for the run's final checkpoint, once it has ended."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    def done():
        runs = _client().read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"evaluate-{run_dir.name}-"))
        )
        return runs[0] if runs and runs[0].state.is_final() else None

    return wait_for(done, timeout_s, f"the evaluation of {run_dir.name}")


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _logs(flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return [
        lg.message
        for lg in _client().read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    ]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deployed")
    runs = tmp / "runs"
    stack = Stack(home=tmp / "stack", port=free_port(), env={"AREAL_RUNS_DIR": str(runs)}, query_seconds=1)
    form = {"config_path": CONFIG, "cache_dir": str(tmp / "cache")}  # else the form's defaults
    try:
        state = stack.up(log=print)
        with prefect_api(state["api_url"]):
            first = _run("train/train", form)
            assert first.state.is_completed(), first.state
            (first_dir,) = runs.iterdir()
            evaluation = _evaluation_of(first_dir)  # it writes into the first run's folder: wait for it
            before = _hashes(first_dir)
            second = _run("train/train", form)
            refused = _run("train/train", {**form, "run_dir": str(first_dir)})
            yield {
                "state": state,
                "runs": runs,
                "first": first,
                "second": second,
                "refused": refused,
                "first_dir": first_dir,
                "before": before,
                "after": _hashes(first_dir),
                "evaluation": evaluation,
                # the flow run's logs reach the server in batches, after its state: wait for its error line
                "refused_logs": wait_for(
                    lambda: (
                        (logs := _logs(refused.id)) and any(refused.state.message in line for line in logs) and logs
                    ),
                    60,
                    "the refused run's error log",
                ),
            }
    finally:
        stack.down(log=print)


@pytest.mark.slow
def test_two_runs_with_the_forms_defaults_get_a_folder_each_and_leave_each_other_alone(deployed):
    d = deployed
    assert d["second"].state.is_completed(), d["second"].state
    folders = sorted(p for p in d["runs"].iterdir() if p.is_dir())
    assert len(folders) == 2 and all((f / "summary.json").exists() for f in folders), folders
    assert all(re.fullmatch(r"tiny-s0-\d{8}-\d{6}(-\d+)?", f.name) for f in folders), folders
    assert d["before"] == d["after"]  # the first run's files, byte for byte (config.json included)
    assert "evals/v2/summary.json" in d["before"]  # (its evaluation had written before the second run)

    refused = d["refused"]
    assert refused.state.is_failed()
    msg = refused.state.message
    assert "already holds a run's checkpoints (latest v2)" in msg and "turn on resume" in msg, msg
    assert "run_dir to None" in msg and "\n" not in msg, msg
    assert not any("Traceback" in line for line in d["refused_logs"]), d["refused_logs"]
    assert any(msg in line for line in d["refused_logs"]), d["refused_logs"]


def _browser_or_skip() -> str:
    from infra.browser import find_browser

    exe = find_browser()
    if exe is None:
        why = (
            "no headless Chromium, so the UI was not checked: `apt-get install -y chromium` "
            "(or chromium-headless-shell; `make test` installs one where apt-get can)"
        )
        if os.environ.get("AREAL_REQUIRE_BROWSER") == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return exe


def _shot(browser, name: str, tmp_path: Path) -> None:
    path = browser.screenshot(tmp_path / f"{name}.png", full_page=True)
    if os.environ.get("AREAL_SCREENSHOT_DIR"):
        shutil.copy(path, os.environ["AREAL_SCREENSHOT_DIR"])


IMAGES = "Array.from(document.images).filter(i => i.src.startsWith('data:image/png'))"


@pytest.mark.slow
def test_the_runs_artifacts_show_its_curves_and_a_rounded_result_in_the_browser(deployed, tmp_path):
    from infra.browser import Browser

    exe = _browser_or_skip()
    d, ui = deployed, deployed["state"]["ui_url"]
    run = d["first"]
    assert run.name == "tiny-s0"  # the config's name and the seed, not a random pair of words
    key = {what: f"{what}-{d['first_dir'].name}" for what in ("train-progress", "train-curves", "train-result")}
    with prefect_api(d["state"]["api_url"]):
        from tasks.flow_runs import ui_link  # the UI a browser opens by default (the new one, under /v2)

        arts = {a.key: a for a in _client().read_artifacts() if a.flow_run_id == run.id and a.key}
        assert set(key.values()) <= set(arts), sorted(arts)
        page = {
            "run": ui_link(f"runs/flow-run/{run.id}?tab=Artifacts"),
            "curves": ui_link(f"artifacts/artifact/{arts[key['train-curves']].id}"),
            "result": ui_link(f"artifacts/artifact/{arts[key['train-result']].id}"),
        }
    assert all(p.startswith(f"{ui}/v2/") for p in page.values()), page

    with Browser(exe) as b:
        b.goto(page["run"])
        b.wait_for(f"document.body.innerText.includes('{key['train-curves']}')", 120, "the run's Artifacts tab")
        assert "tiny-s0" in b.evaluate("document.body.innerText")
        _shot(b, "train_run_artifacts", tmp_path)

        b.goto(page["curves"])
        widths = b.wait_for(
            f"{IMAGES}.length && {IMAGES}.every(i => i.complete) && {IMAGES}.map(i => i.naturalWidth)",
            120,
            "the learning curves' image",
        )
        assert widths[0] > 300, widths  # decoded and drawn, not a broken image
        _shot(b, "train_curves", tmp_path)

        b.goto(page["result"])
        shown = b.wait_for(  # read in one go: the page may draw itself again meanwhile
            "(() => { const th = Array.from(document.querySelectorAll('table th')).map(t => t.innerText.trim());"
            " return th.length >= 2 && {header: th, table: document.querySelector('table').innerText,"
            " links: Array.from(document.querySelectorAll('a')).map(a => a.href)}; })()",
            120,
            "the result table",
        )
        header, table, links = shown["header"], shown["table"], shown["links"]
        assert header == ["measure", "value"], header  # a header row that says what the columns are
        assert "held-out accuracy" in table and "every trajectory trained exactly once" in table, table
        assert not re.search(r"\d\.\d{5,}", table), table  # rounded for people
        _shot(b, "train_result", tmp_path)
    evaluation = [h for h in links if "/artifacts/artifact/" in h]
    assert d["evaluation"].state.is_completed() and evaluation, links  # the evaluation itself, not its key's history
    assert not [h for h in links if "/artifacts/key/" in h and "evaluation" in h], links
