"""The Prefect server a command reports to (infra/command_server.py): the user's when one is named,
else one of the command's own, in a session of its own, gone when the command is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from infra.command_server import prefect_api

REPO = Path(__file__).resolve().parents[2]

# a command that takes its own server, says where it is and what runs it, then dies without a word
DIES = """
import json, os, signal, psutil
from infra.command_server import prefect_api
with prefect_api() as url:
    (server,) = psutil.Process().children()
    print(json.dumps({"url": url, "server": server.pid, "pgid": os.getpgid(server.pid)}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_named_server_is_used_and_nothing_is_started():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}), prefect_api() as url:
        assert url == "http://127.0.0.1:9/api"
        assert {p.pid for p in psutil.Process().children(recursive=True)} == before


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_the_commands_own_server_answers_in_its_own_session_and_goes_when_the_command_dies():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    r = subprocess.run([sys.executable, "-c", DIES], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["pgid"] == info["server"]  # a session of its own: the terminal's Ctrl-C does not reach it
    deadline = time.monotonic() + 30
    while psutil.pid_exists(info["server"]) and psutil.Process(info["server"]).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the server outlived the command that started it"
        time.sleep(0.2)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{info['url']}/health", timeout=2)
