"""A rollout server pool kept up on its own (areal_core.ops.serve, flows/serve.py): real embedded
servers, a real generation through them, a killed server brought back, and the Prefect flow
publishing the URLs in a Variable while they are up."""

import asyncio
import threading
import time

import psutil
import pytest

from areal_core.experiment import load_config
from areal_core.ops.serve import serve_rollout
from areal_core.rollout.backend import Sampling
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from tests.e2e.test_rollout_server import tiny_qwen2

CONFIG = "tests/data/e2e.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-model") / "v0"
    tiny_qwen2(0).save_pretrained(path)
    return str(path)


def _listener(url: str) -> psutil.Process:
    port = int(url.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port)
    return psutil.Process(pid)


async def _generate(url: str) -> list[int]:
    client = EmbeddedClient(url, 60.0)
    try:
        out = await client.generate([5, 6, 7, 8], Sampling(max_new_tokens=6, temperature=1.0))
    finally:
        await client.aclose()
    return out.output_ids


@pytest.mark.slow
@pytest.mark.nightly
def test_pool_serves_restarts_a_dead_server_and_stops(model_dir, tmp_path):
    cfg = load_config(CONFIG, {"rollout.n_servers": 2})
    up, checks, stop, result = [], [], threading.Event(), {}
    t = threading.Thread(
        target=lambda: result.update(
            serve_rollout(
                cfg,
                model_dir,
                log_dir=tmp_path,
                check_every_s=0.5,
                on_up=up.extend,
                on_check=checks.append,
                should_stop=stop.is_set,
            )
        ),
        daemon=True,
    )
    t.start()
    try:
        deadline = time.monotonic() + 120
        while not up and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(up) == 2, up
        assert all(len(asyncio.run(_generate(u))) > 0 for u in up)

        victim = _listener(up[1])
        victim.kill()
        victim.wait(10)
        deadline = time.monotonic() + 120  # the next check sees it down and restarts it
        while not (any(False in c for c in checks) and checks[-1] == [True, True]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [True, False] in checks and checks[-1] == [True, True], checks[-3:]
        assert len(asyncio.run(_generate(up[1]))) > 0  # the same URL serves again
        servers = [_listener(u) for u in up]
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and result["restarts"] == 1 and result["urls"] == up
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_not_a_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        serve_rollout(load_config(CONFIG), str(tmp_path), log_dir=tmp_path, hold_s=0)


def test_hold_counts_from_when_the_servers_are_up(model_dir, tmp_path, monkeypatch):
    """A slow launch (a loaded machine, a big model) does not eat the hold: the pool stays up hold_s
    after on_up, and is health-checked in that time."""
    import contextlib

    import areal_core.ops.serve as serve

    class SlowBackend:
        name, restartable, api_key = "slow", False, "k"

        @contextlib.contextmanager
        def launch(self, model_path, version):
            time.sleep(1.5)
            yield ["http://127.0.0.1:1"]

        def client(self, url, timeout_s):
            class Client:
                async def health(self):
                    return True

                async def aclose(self):
                    pass

            return Client()

    monkeypatch.setattr(serve, "make_backend", lambda *a, **k: SlowBackend())
    up_at, checks = [], []
    result = serve_rollout(
        load_config(CONFIG),
        model_dir,
        log_dir=tmp_path,
        hold_s=1.0,
        check_every_s=0.2,
        on_up=lambda urls: up_at.append(time.monotonic()),
        on_check=checks.append,
    )
    assert time.monotonic() - up_at[0] >= 1.0 and result["up_s"] >= 1.0
    assert len(checks) >= 3 and all(ok == [True] for ok in checks)


@pytest.mark.slow
def test_flow_publishes_urls_while_up(model_dir, tmp_path, monkeypatch, prefect_harness):
    from prefect.variables import Variable

    import flows.serve
    from flows.serve import rollout_servers, urls_variable

    seen_event = threading.Event()  # the pool stays up until the test has read the Variable (or 120 s)
    real = flows.serve.serve_rollout
    monkeypatch.setattr(flows.serve, "serve_rollout", lambda *a, **k: real(*a, **k, should_stop=seen_event.is_set))
    name = urls_variable("e2e")
    seen, result = [], {}
    t = threading.Thread(
        target=lambda: result.update(
            rollout_servers(model_dir, CONFIG, hold_s=120.0, check_every_s=1.0, log_dir=str(tmp_path))
        ),
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 180
    while t.is_alive() and not seen and time.monotonic() < deadline:
        seen = Variable.get(name) or []
        time.sleep(0.3)
    seen_event.set()
    t.join(60)
    assert seen and seen == result["urls"] and all(u.startswith("http://127.0.0.1:") for u in seen)
    assert Variable.get(name) is None  # removed once the servers stopped


def test_serve_command_without_prefect_serves_for_hold_s_then_stops(model_dir, tmp_path, capsys):
    from flows.cli import main

    log_dir = tmp_path / "logs" / "new"  # made by the command
    assert (
        main(["serve", model_dir, "--config", CONFIG, "--hold-s", "2", "--no-prefect", "--log-dir", str(log_dir)]) == 0
    )
    out = capsys.readouterr().out
    assert "rollout servers up: http://127.0.0.1:" in out and '"restarts": 0' in out
    assert (log_dir / "rollout_server_0.log").is_file()
