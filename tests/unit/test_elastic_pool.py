"""Elastic pools without server processes: a pool's joins and leaves, an answer continued on another
server from what a dead one had generated, and the join list."""

import asyncio

import pytest

from areal_core.controller.elastic import announce, url_list
from areal_core.controller.generation import Generator
from areal_core.controller.recovery import ServerRecovery
from areal_core.controller.settings import ControllerSettings, Servers
from areal_core.rollout.backend import Generation, Sampling
from areal_core.rollout.client import RolloutServerError
from areal_core.rollout.pool import RolloutPool
from areal_core.types import Trajectory
from tests.fake_servers import RecordingTransport, ScriptedServer


class DeadServer(ScriptedServer):
    """Died while generating: every request fails as unreachable."""

    async def generate(self, input_ids, sampling, rid=None):
        self.prompts.append(list(input_ids))
        raise RolloutServerError(self.url, None, "connection refused")

    async def health(self):
        return False


def test_a_pool_keeps_indices_as_servers_leave_and_join():
    async def main():
        pool = RolloutPool(["http://a", "http://b"], make_client=ScriptedServer)
        pool.leave(0)
        assert [c.url for c in pool.live()] == ["http://b"]
        for _ in range(4):  # a server that left gets nothing
            await pool.generate([5, 6], Sampling(max_new_tokens=2))
        assert pool.sent == [0, 4]
        i = pool.join(ScriptedServer("http://a"))  # the same URL again: a new member, held until released
        assert i == 2 and pool.index("http://a") == 2
        await pool.generate([5], Sampling(max_new_tokens=2))
        assert pool.sent[2] == 0
        await pool.release(i)
        await asyncio.gather(*(pool.generate([5], Sampling(max_new_tokens=2)) for _ in range(4)))
        assert pool.sent[2] > 0 and pool.sent[0] == 0

    asyncio.run(main())


def _generator(urls: list[str], make) -> Generator:
    settings = ControllerSettings(
        batch_size=1, eta=1, n_samples=1, sampling=Sampling(max_new_tokens=8), reward_correct=1.0, reward_wrong=0.0
    )
    recovery = ServerRecovery(RecordingTransport(), 5.0, None, "", 0, elastic=True)
    gen = Generator(settings, recovery, lambda: 0)
    gen.open(Servers(urls, make_client=make), None)
    return gen


@pytest.mark.parametrize("read_before_death", [True, False])
def test_an_answer_continues_on_another_server_from_what_the_dead_one_generated(read_before_death):
    async def main():
        made = {}

        def make(url, timeout_s=0):
            made[url] = (DeadServer if url == "http://dead" else ScriptedServer)(url)
            made[url].version = 2
            return made[url]

        gen = _generator(["http://dead", "http://ok"], make)
        gen.pools["trainable"].in_flight[1] = 5  # the dead one looks least busy: it is picked first
        traj = Trajectory(traj_id="e0-p1-s0", group_id="e0-p1", seq_no=0, admit_version=1, prompt_ids=[7, 8])
        if read_before_death:  # the last read of partial outputs saw 3 tokens of it, sampled by version 1
            gen.partials = {traj.traj_id: (0, Generation([20, 21, 22], [-0.5] * 3, [1] * 3, ""))}
        await gen.finish(traj)
        assert made["http://dead"].prompts == [[7, 8]]
        assert gen.pools["trainable"].gone == [True, False]
        assert gen.resubmitted == 1 and gen.recovery.left == ["http://dead"]
        if read_before_death:  # continued from the prefix, re-prefilled on the other server
            assert made["http://ok"].prompts == [[7, 8, 20, 21, 22]]
            assert traj.output_ids == [20, 21, 22, 7, 3]
            assert traj.output_versions == [1, 1, 1, 2, 2] and traj.output_logprobs[:3] == [-0.5] * 3
            assert gen.prefix_kept == 3
        else:  # nothing was read: it starts again from the prompt
            assert made["http://ok"].prompts == [[7, 8]]
            assert traj.output_ids == [7, 3] and gen.prefix_kept == 0
        assert traj.finish_reason == "stop"

    asyncio.run(main())


def test_a_prefix_read_before_the_answer_moved_on_is_not_reused():
    async def main():
        gen = _generator(
            ["http://dead", "http://ok"],
            lambda url, timeout_s=0: (DeadServer if url == "http://dead" else ScriptedServer)(url),
        )
        gen.pools["trainable"].in_flight[1] = 5
        traj = Trajectory(
            traj_id="t",
            group_id="g",
            seq_no=0,
            admit_version=0,
            prompt_ids=[7],
            output_ids=[9],
            output_logprobs=[-1.0],
            output_versions=[0],
        )
        gen.partials = {"t": (0, Generation([20], [-0.5], [0], ""))}  # read when it held nothing: stale
        await gen.finish(traj)
        assert traj.output_ids == [9, 7, 3] and gen.prefix_kept == 0

    asyncio.run(main())


def test_the_join_list(tmp_path):
    path = str(tmp_path / "join.txt")
    assert url_list(path)() == []  # no file yet: nobody joins
    announce(path, ["http://h1:30000/", "http://h2:30000"])
    announce(path, ["http://h2:30000", "http://h3:30000"])
    (tmp_path / "join.txt").write_text((tmp_path / "join.txt").read_text() + "\n# a comment\nhttp://h4:1  # spare\n")
    assert url_list(path)() == ["http://h1:30000/".rstrip("/"), "http://h2:30000", "http://h3:30000", "http://h4:1"]
    announce(path, ["http://h2:30000"], present=False)
    assert url_list(path)() == ["http://h1:30000", "http://h3:30000", "http://h4:1"]


def test_min_servers_beyond_the_first_servers_needs_a_join_list():
    from areal_core.experiment import load_config

    two = {"rollout.backend": {"kind": "external", "urls": ["http://a:1", "http://b:1"], "allow_unauthenticated": True}}
    with pytest.raises(ValueError, match=r"rollout.min_servers \(3\) is more than the 2 server\(s\).*join_from"):
        load_config("configs/quickstart.yaml", {**two, "rollout.min_servers": 3})
    assert (
        load_config(
            "configs/quickstart.yaml", {**two, "rollout.min_servers": 3, "rollout.join_from": "join.txt"}
        ).rollout.min_servers
        == 3
    )
