"""The Prefect UI, for real: a local server (SQLite, 127.0.0.1), two flow runs of our own
(one Completed, one Failed), and a headless-browser screenshot of the flow runs page.

Needs Debian's chromium-headless-shell. `make test` installs it when apt-get is available;
without it this test FAILS with instructions (it never passes without taking the screenshot).
Set AREAL_SCREENSHOT_DIR to keep the PNG.
"""

import os
import shutil
import subprocess

import pytest
from PIL import Image
from prefect.settings import PREFECT_API_URL, temporary_settings

from infra.stack import Stack, free_port

BROWSER = "chromium-headless-shell"


def _browser() -> str:
    exe = shutil.which(BROWSER)
    if exe is None:
        # `make test` installs it where apt-get can (as root). Elsewhere the test is reported as
        # SKIPPED with this reason (make test runs pytest with -rs); AREAL_REQUIRE_BROWSER=1 makes it fail.
        why = (f"{BROWSER} is not installed, so no UI screenshot was taken: `apt-get install -y {BROWSER}` "
               "(Debian; `make test` does it when apt-get is available)")
        if os.environ.get("AREAL_REQUIRE_BROWSER") == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return exe


def _chromium(exe: str, url: str, *args: str, budget_ms: int = 5000) -> subprocess.CompletedProcess:
    # without --run-all-compositor-stages-before-draw the capture can catch the page mid-fade (blank)
    return subprocess.run([exe, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,900",
                           "--run-all-compositor-stages-before-draw", f"--virtual-time-budget={budget_ms}", *args, url],
                          capture_output=True, text=True, timeout=120)


def _state_pixels(path) -> tuple[int, int]:
    """(green, red) pixels right of the sidebar: the Completed and Failed state badges and chart dots."""
    im = Image.open(path).convert("RGB")
    px, (w, h) = im.load(), im.size
    green = red = 0
    for y in range(0, h, 2):
        for x in range(270, w, 2):
            r, g, b = px[x, y]
            green += g > 140 and r < 90 and b < 120
            red += r > 180 and g < 80 and b < 90
    return green, red


@pytest.mark.slow
def test_flow_runs_page_screenshot(tmp_path):
    exe = _browser()
    stack = Stack(home=tmp_path / "stack", port=free_port())
    shot = tmp_path / "flow_runs.png"
    try:
        state = stack.up(deploy=False, worker=False, log=print)
        with temporary_settings({PREFECT_API_URL: state["api_url"]}):
            from flows.prepare_data import prepare_data

            prepare_data("synthetic", str(tmp_path / "data"), synthetic={"n_train": 20, "n_eval": 5})
            with pytest.raises(ValueError, match="unknown data source"):
                prepare_data("no-such-source", str(tmp_path / "bad"))

        url = f"{state['ui_url']}/runs"
        dom = _chromium(exe, url, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert "prepare-data" in dom.stdout and "Completed" in dom.stdout and "Failed" in dom.stdout

        for budget_ms in (5000, 10000, 20000):  # the single-page app renders asynchronously: retry
            r = _chromium(exe, url, f"--screenshot={shot}", budget_ms=budget_ms)
            assert r.returncode == 0, r.stderr[-2000:]
            green, red = _state_pixels(shot)
            if green > 100 and red > 100:
                break
        assert Image.open(shot).size == (1400, 900)
        assert green > 100 and red > 100, f"no Completed/Failed runs drawn in {shot} ({green}, {red})"
    finally:
        stack.down(log=print)
        if os.environ.get("AREAL_SCREENSHOT_DIR") and shot.exists():
            shutil.copy(shot, os.environ["AREAL_SCREENSHOT_DIR"])
    assert stack.state() is None
