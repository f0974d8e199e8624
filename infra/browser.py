"""A headless Chromium driven over the DevTools protocol: open a page of the Prefect UI, wait until
something holds in it (a script returns true), read values from it, take a screenshot.

Used by the UI tests and to take the screenshots in docs/img:

    python -m infra.browser URL OUT.png [--width 1400] [--height 900] [--wait-for JS]

The browser is Debian's ``chromium-headless-shell`` or ``chromium`` (``apt-get install -y chromium``).
Each :class:`Browser` starts its own browser process (its own session, a fresh profile folder)
and stops it by its PID.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


class BrowserError(RuntimeError):
    pass


def find_browser() -> str | None:
    """The path of an installed headless Chromium, or None."""
    for name in BROWSERS:
        exe = shutil.which(name)
        if exe:
            return exe
    return None


class Browser:
    """One browser process with one page; use as a context manager."""

    def __init__(self, exe: str | None = None, width: int = 1400, height: int = 900, startup_s: float = 60.0):
        self.exe = exe or find_browser()
        if self.exe is None:
            raise BrowserError(f"no headless Chromium found ({' or '.join(BROWSERS)}): apt-get install -y chromium")
        self.width, self.height, self.startup_s = width, height, startup_s
        self._profile = tempfile.mkdtemp(prefix="areal-browser-")
        self._proc: subprocess.Popen | None = None
        self._ws = None
        self._id = 0

    def __enter__(self) -> Browser:
        from websockets.sync.client import connect

        self._proc = subprocess.Popen(
            [
                self.exe,
                *FLAGS,
                f"--user-data-dir={self._profile}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port_file = Path(self._profile) / "DevToolsActivePort"
            deadline = time.monotonic() + self.startup_s
            while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise BrowserError(f"{self.exe} did not start (exit code {self._proc.poll()})")
                time.sleep(0.1)
            port = int(port_file.read_text().splitlines()[0])
            targets = self._json(f"http://127.0.0.1:{port}/json/list")
            page = next(t for t in targets if t.get("type") == "page")
            self._ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            self.call("Page.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _json(url: str):
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def call(self, method: str, timeout_s: float = 60.0, **params) -> dict:
        """Send one DevTools command and return its result (events meanwhile are skipped)."""
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, what: str = ""):
        """Poll until ``expression`` is truthy; return its value."""
        deadline, error = time.monotonic() + timeout_s, None
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError as e:  # e.g. no document.body yet while the page loads
                value, error = None, e
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(
                    f"timed out after {timeout_s:.0f}s waiting for {what or expression[:120]}"
                    + (f" (last error: {error})" if error else "")
                )
            time.sleep(0.25)

    def screenshot(self, path: str | os.PathLike, full_page: bool = False) -> Path:
        params: dict = {"format": "png"}
        if full_page:
            h = int(self.evaluate("Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)"))
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": max(h, self.height), "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", **params)["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)  # the browser and its helper processes
            except ProcessLookupError:
                pass
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.browser", description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=900)
    p.add_argument(
        "--wait-for",
        default="document.readyState === 'complete'",
        help="a JavaScript expression to wait for before the screenshot",
    )
    p.add_argument("--full-page", action="store_true")
    args = p.parse_args(argv)
    try:
        with Browser(width=args.width, height=args.height) as b:
            b.goto(args.url)
            b.wait_for(args.wait_for)
            time.sleep(1.0)  # the page's last transitions
            print(b.screenshot(args.out, full_page=args.full_page))
    except BrowserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
