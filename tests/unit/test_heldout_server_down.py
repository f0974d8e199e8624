"""The held-out evaluation goes on past a server that is down (as when one is lost while a run ends),
and fails with the server's error where none is left or the error is not a lost server."""

import asyncio
from types import SimpleNamespace

import pytest

from areal_core.eval.heldout import _generate_all
from areal_core.rollout.backend import Generation, Sampling
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.protocol import FinishReason

PROMPTS = [SimpleNamespace(id=k, input_ids=[1, 2, k]) for k in range(12)]


def clients(behaviour: dict[str, str]):
    """A client per URL that answers ("ok"), is unreachable ("down") or answers HTTP 400 ("bad")."""
    asked: dict[str, int] = dict.fromkeys(behaviour, 0)

    class Client:
        def __init__(self, url, timeout_s):
            self.url = url

        async def generate(self, input_ids, sampling, rid=None):
            asked[self.url] += 1
            await asyncio.sleep(0)
            how = behaviour[self.url]
            if how == "down":
                raise RolloutServerError(self.url, None, "POST /generate: ConnectionRefusedError()")
            if how == "bad":
                raise RolloutServerError(self.url, 400, "bad request")
            return Generation([input_ids[-1]], [0.0], [0], FinishReason(type="length"))

        async def aclose(self):
            pass

    return Client, asked


def run(behaviour):
    make, asked = clients(behaviour)
    out = asyncio.run(_generate_all(list(behaviour), PROMPTS, Sampling(max_new_tokens=1), 5.0, make))
    return out, asked


@pytest.mark.parametrize("order", [("down", "ok"), ("ok", "down"), ("ok", "down", "ok")])
def test_a_server_down_leaves_service_and_every_prompt_is_answered(order, caplog):
    behaviour = {f"http://127.0.0.1:{9000 + k}": how for k, how in enumerate(order)}
    out, asked = run(behaviour)
    assert [g.output_ids for g in out] == [[k] for k in range(12)]  # each prompt's own answer, in order
    down = next(u for u, how in behaviour.items() if how == "down")
    assert 1 <= asked[down] <= len(PROMPTS)  # tried, then out of service
    assert sum(asked[u] for u, how in behaviour.items() if how == "ok") == len(PROMPTS)
    assert f"{down}: unreachable" in caplog.text and caplog.text.count("its prompts go to the other servers") == 1


def test_with_every_server_down_the_error_is_raised():
    with pytest.raises(RolloutServerError, match="unreachable"):
        run({"http://127.0.0.1:9000": "down", "http://127.0.0.1:9001": "down"})


def test_an_error_that_is_not_a_lost_server_is_raised_at_once():
    with pytest.raises(RolloutServerError, match="HTTP 400"):
        run({"http://127.0.0.1:9000": "bad", "http://127.0.0.1:9001": "ok"})
