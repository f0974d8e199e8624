"""Every endpoint of a run is authenticated, and a program the policy wrote reaches none of them.

The real services, started here on 127.0.0.1: the reward service's Dask cluster (TLS with certificates
made for it: scheduler, nanny, worker), an embedded rollout server (a bearer token on all but
``/health``) and the OpenAI-compatible endpoint of the ``openai_agent`` episode (a bearer token on
every path).

* A program graded through ``grade_batch`` on the cluster's worker, in each sandbox mode this machine
  runs, tries each of them and prints what it reached: nothing (where the sandbox has no network, it
  cannot even connect; elsewhere it would meet TLS it has no certificate for, and 401s).
* This test process, which can reach them, shows the second layer: no Dask connection without the
  cluster's certificate (none, or another CA's), 401 from the server and the endpoint without the key.
* An external ``tls://`` scheduler is reached with the certificate files the config names.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx
import pytest

from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import grade_batch
from areal_core.reward.sandbox import guarantees
from areal_core.reward.service import RewardService
from areal_core.rollout.backends.embedded.launcher import start_server
from tests.e2e.test_rollout_server import tiny_qwen2
from tests.e2e.test_sandbox_hostile import _modes

# What the program does: stdlib only (the namespaces mode's root has nothing else). For each target it
# connects; a Dask one gets a TLS handshake without a client certificate and a message, an HTTP one a
# request without a key. It prints one line per target: what it reached.
PROBE = r"""
import http.client, json, socket, ssl, sys
targets = json.loads(TARGETS)

def dask(host, port):
    try:
        raw = socket.create_connection((host, port), timeout=2)
    except OSError:
        return "unreachable"
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        s = ctx.wrap_socket(raw)
        s.sendall(b"\x00" * 64)
        data = s.recv(64)
        return "tls refused" if not data else "ANSWERED " + repr(data[:20])
    except (ssl.SSLError, OSError):
        return "tls refused"

def web(host, port, method, path):
    try:
        c = http.client.HTTPConnection(host, port, timeout=3)
        c.request(method, path, body=b"{}", headers={"content-type": "application/json"})
        status = c.getresponse().status
    except OSError:
        return "unreachable"
    return "401" if status == 401 else "ANSWERED %d" % status

for name, host, port, kind, method, path in targets:
    print(name + ": " + (dask(host, port) if kind == "dask" else web(host, port, method, path)))
"""


def _source(targets: list) -> str:
    return "TARGETS = " + repr(json.dumps(targets)) + "\n" + PROBE


def _answer(targets: list) -> str:  # as a policy's answer: the program in a fenced block
    return "```python\n" + _source(targets) + "\n```"


class _Endpoint:
    """The openai_agent episode's endpoint, served on a loop of its own (as in a run: on the rollout loop)."""

    def __init__(self):
        from areal_core.episodes.openai_agent import OpenAIAgent

        self.agent = OpenAIAgent(lambda client, prompt: "")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.agent.port(), self.loop).result(30)

    def close(self):
        async def stop():
            self.agent._server[1].cancel()
            await asyncio.gather(self.agent._server[1], return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    tiny_qwen2(3).save_pretrained(root / "v0")
    endpoint = _Endpoint()
    try:
        with (
            RewardService(RewardConfig(n_workers=1)) as rewards,
            start_server(str(root / "v0"), log_path=str(root / "server.log"), startup_timeout_s=120) as server,
        ):
            workers = rewards.client.scheduler_info()["workers"]
            worker, info = next(iter(workers.items()))

            def hp(address: str) -> tuple[str, int]:
                host, port = address.split("://", 1)[1].rsplit(":", 1)
                return host, int(port)

            targets = [
                ("scheduler", *hp(rewards.scheduler_address), "dask", "", ""),
                ("worker", *hp(worker), "dask", "", ""),
                ("nanny", *hp(info["nanny"]), "dask", "", ""),
                ("rollout server", "127.0.0.1", server.port, "http", "POST", "/pause_generation"),
                ("rollout weights", "127.0.0.1", server.port, "http", "POST", "/update_weights_from_disk"),
                ("proxy", "127.0.0.1", endpoint.port, "http", "GET", "/v1/models"),
            ]
            yield {"rewards": rewards, "server": server, "endpoint": endpoint, "targets": targets}
    finally:
        endpoint.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes())
def test_a_sandboxed_program_reaches_no_service_of_the_run(services, mode):
    rewards, targets = services["rewards"], services["targets"]

    def set_mode(mode: str) -> str:  # on the worker (sent by value): the sandbox mode its gradings use
        import os

        from areal_core.reward.sandbox import sandbox_mode

        os.environ["AREAL_SANDBOX_MODE"] = mode
        sandbox_mode.cache_clear()
        return sandbox_mode()

    assert set(rewards.client.run(set_mode, mode).values()) == {mode}
    if guarantees(mode)["no_network"]:  # an empty network namespace: nothing to connect to
        expect = {name: "unreachable" for name, *_ in targets}
    else:  # it connects, and meets TLS it has no certificate for, and 401s
        expect = {name: "tls refused" if kind == "dask" else "401" for name, _, _, kind, _, _ in targets}
    want = "".join(f"{name}: {what}\n" for name, what in expect.items())
    tests = [{"testtype": "stdin", "input": "", "output": want}]
    [verdict] = rewards.client.submit(grade_batch, [("code", _answer(targets), "", tests)], 60.0).result()
    if not verdict.correct:  # what it did reach, for the message
        from areal_core.reward.code import grade_code

        got = rewards.client.submit(grade_code, _source(targets), tests).result()
        raise AssertionError(f"the sandboxed program reached: {got.details}; expected {expect}")
    server = services["server"]
    info = httpx.get(
        server.url + "/get_model_info", headers={"Authorization": f"Bearer {server.api_key}"}, trust_env=False
    ).json()
    assert not info["paused"] and info["weight_version"] == 0


def test_no_process_without_the_clusters_certificate_reaches_the_cluster(services):
    from distributed import Security
    from distributed.comm import connect

    rewards = services["rewards"]
    address = rewards.scheduler_address
    assert address.startswith("tls://127.0.0.1:")
    # comms, not Clients: a Client's own IO-loop thread can be slow to start on a loaded machine (once it hung
    # for the whole test timeout), which is not what this checks
    with pytest.raises((TypeError, OSError)):  # no certificate at all
        asyncio.run(connect(address, timeout=5))
    with pytest.raises(OSError):  # plain TCP: the scheduler speaks TLS only
        asyncio.run(connect(address.replace("tls://", "tcp://"), timeout=5))
    other = Security.temporary()  # a certificate of another CA: the handshake is refused, both ways
    with pytest.raises(OSError, match="certificate"):
        asyncio.run(connect(address, timeout=5, **other.get_connection_args("client")))
    worker = next(iter(rewards.client.scheduler_info()["workers"]))
    with pytest.raises(OSError):
        asyncio.run(connect(worker, timeout=5, **other.get_connection_args("client")))
    # the run's own certificate works (the control)
    assert rewards.client.run_on_scheduler(os.getpid) > 0


def test_an_external_tls_scheduler_is_reached_with_the_configured_certificates(services):
    rewards = services["rewards"]
    settings = rewards.client_settings()  # the files a cluster operator would hand out
    assert settings["scheduler_address"] == rewards.scheduler_address
    cfg = RewardConfig(**settings)
    with RewardService(cfg) as external:
        [r] = external.grade_many("chain", ["a1b2|2"], ["a1b2|2"])
    assert r.correct
    with pytest.raises(ValueError, match=r"give reward.tls_ca_file and tls_client_cert"):
        RewardConfig(scheduler_address="tls://10.0.0.1:8786")
    with pytest.raises(ValueError, match=r"only for a tls:// reward.scheduler_address"):
        RewardConfig(scheduler_address="tcp://10.0.0.1:8786", tls_ca_file="ca.pem")


def test_an_evaluation_grades_on_an_external_tls_scheduler_given_its_files(services, capsys):
    """``areal-flow eval --scheduler tls://... --tls-ca-file ... --tls-cert ... --tls-key ...`` (the evaluate
    deployment's ``reward``): the answers are graded on that cluster; without the files, one clear line."""
    from flows.cli import main

    rewards = services["rewards"]
    s = rewards.client_settings()

    def transitions(dask_scheduler) -> int:  # the scheduler's count of task state changes so far
        return dask_scheduler.transition_counter

    before = rewards.client.run_on_scheduler(transitions)
    flags = [
        "--scheduler",
        s["scheduler_address"],
        "--tls-ca-file",
        s["tls_ca_file"],
        "--tls-cert",
        s["tls_client_cert"],
    ]
    flags += ["--tls-key", s["tls_client_key"]] if s.get("tls_client_key") else []
    assert main(["eval", "--bench", "gsm8k", "--reference", "--limit", "4", "--no-progress", *flags]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["accuracy"] == 1.0 and report["n"] == 4
    assert rewards.client.run_on_scheduler(transitions) > before  # graded there
    assert main(["eval", "--bench", "gsm8k", "--reference", "--scheduler", s["scheduler_address"]]) == 2
    assert "give --tls-ca-file and --tls-cert" in capsys.readouterr().err


def test_the_server_and_the_endpoint_answer_401_without_the_key(services):
    server, endpoint = services["server"], services["endpoint"]
    for path in (
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/pause_generation",
        "/generate",
    ):
        r = httpx.post(server.url + path, json={}, trust_env=False)
        assert r.status_code == 401 and "API key" in r.json()["message"], (path, r.text)
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
    base = f"http://127.0.0.1:{endpoint.port}/v1"
    for headers in ({}, {"Authorization": "Bearer guess"}):
        r = httpx.get(base + "/models", headers=headers, trust_env=False)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.get(base + "/models", headers={"Authorization": f"Bearer {endpoint.agent.secret}"}, trust_env=False)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
