"""A request that gets no answer in time says so and names the setting to raise, apart from a server
that cannot be reached at all."""

import asyncio

import pytest

from areal_core.rollout.client import HTTPClient, RolloutServerError


async def _silent_server():
    """A server that takes the connection and the request and never answers."""

    async def hold(reader, writer):
        await reader.read(1024)
        await asyncio.sleep(30)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_request_past_its_timeout_names_the_setting():
    async def go():
        server, port = await _silent_server()
        client = HTTPClient(f"http://127.0.0.1:{port}", timeout_s=0.3, api_key="k")
        try:
            with pytest.raises(RolloutServerError) as e:
                await client._request("POST", "/generate", "{}")
        finally:
            await client.aclose()
            server.close()
        return e.value

    err = asyncio.run(go())
    assert err.timed_out and err.status is None
    assert err.server_down  # the controller aborts it and sends it again, as for a server that went away
    text = str(err)
    assert "no answer in time" in text and "unreachable" not in text
    assert "no answer within 0.3 s;" in text and "(a run's rollout.request_timeout_s)" in text


def test_a_refused_connection_is_unreachable_not_a_timeout():
    async def go():
        client = HTTPClient("http://127.0.0.1:9", timeout_s=2, retries=0, api_key="k")
        try:
            with pytest.raises(RolloutServerError) as e:
                await client._request("GET", "/model_info")
        finally:
            await client.aclose()
        return e.value

    err = asyncio.run(go())
    assert not err.timed_out and "unreachable" in str(err) and "request_timeout_s" not in str(err)
