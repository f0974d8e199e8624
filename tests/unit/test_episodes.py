"""Episodes (areal_core/episodes): the retry-with-feedback logic on a scripted context: which
answers get another turn, what is masked, what is graded, and the discounted credit."""

import asyncio

import pytest

from areal_core.episodes import RetryWithFeedback, SingleTurn, make_episode
from areal_core.episodes.config import ImportedConfig, RetryConfig, SingleTurnConfig
from areal_core.reward.result import RewardResult
from areal_core.types import Trajectory


class ScriptedContext:
    """Answers come from a script per trajectory and turn; an answer is right when it reads 'ok'."""

    version = 3

    def __init__(self, script: dict[str, list[str]], limit: int | None = None):
        self.script, self.graded, self.turn = script, [], dict.fromkeys(script, 0)
        self.limit = limit  # tokens a trajectory may hold (None: no limit)

    def room(self, traj):
        return None if self.limit is None else self.limit - len(traj.prompt_ids) - len(traj.output_ids)

    async def generate(self, trajs, max_new_tokens=None):
        for t in trajs:
            text = self.script[t.traj_id][self.turn[t.traj_id]]
            self.turn[t.traj_id] += 1
            ids = self.encode(text)[: max_new_tokens or None]
            if t.output_mask:
                t.output_mask += [1] * len(ids)
            t.output_ids += ids
            t.output_logprobs += [-0.5] * len(ids)
            t.output_versions += [self.version] * len(ids)
            t.finish_reason = "stop"

    async def grade(self, trajs, texts):
        self.graded.append(list(texts))
        return [RewardResult(correct=x == "ok", parsed=x, reason="ok" if x == "ok" else "wrong answer") for x in texts]

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def _group(n):
    return [Trajectory(traj_id=f"t{i}", group_id="g", seq_no=i, admit_version=3, prompt_ids=[1, 2]) for i in range(n)]


def test_retry_gives_wrong_answers_feedback_and_another_turn():
    ctx = ScriptedContext({"t0": ["ok"], "t1": ["no", "ok"], "t2": ["no", "no", "no"]})
    group = _group(3)
    results = asyncio.run(RetryWithFeedback(max_turns=3, feedback="|{reason}|").run(group, ctx))
    assert [r.correct for r in results] == [True, True, False]
    assert [t.reward_info["turns"] for t in group] == [1, 2, 3]
    # only each latest turn is graded, and only the wrong ones again
    assert ctx.graded == [["ok", "no", "no"], ["ok", "no"], ["no"]]
    t1 = group[1]
    assert ctx.decode(t1.output_ids) == "no|wrong answer|ok"
    assert t1.output_mask == [1, 1] + [0] * len("|wrong answer|") + [1, 1]
    assert len(t1.output_logprobs) == len(t1.output_versions) == len(t1.output_ids)
    assert group[0].output_mask == []  # untouched: every token the policy's


def test_retry_stops_where_the_feedback_no_longer_fits():
    """A trajectory may hold 20 tokens (prompt 2): after "no" (2) the feedback "|wrong answer|" (14) leaves
    2, enough for a try; after a second "no" there is no room for the feedback and a token more, so that
    answer ends there, wrong, with nothing past the limit."""
    ctx = ScriptedContext({"t0": ["no", "no", "ok"], "t1": ["no", "ok"]}, limit=20)
    group = _group(2)
    results = asyncio.run(RetryWithFeedback(max_turns=3, feedback="|{reason}|").run(group, ctx))
    assert [r.correct for r in results] == [False, True]
    assert [t.reward_info["turns"] for t in group] == [2, 2]
    assert ctx.decode(group[0].output_ids) == "no|wrong answer|no"
    assert all(len(t.prompt_ids) + len(t.output_ids) <= 20 for t in group)


def test_discount_scales_the_credit_of_a_late_right_answer():
    ctx = ScriptedContext({"t0": ["ok"], "t1": ["no", "ok"], "t2": ["no", "no"]})
    results = asyncio.run(RetryWithFeedback(max_turns=2, discount=0.5).run(_group(3), ctx))
    assert [r.score for r in results] == [1.0, 0.5, 0.0]


def test_single_turn_grades_the_whole_answer_once():
    ctx = ScriptedContext({"t0": ["ok"], "t1": ["no"]})
    results = asyncio.run(SingleTurn().run(_group(2), ctx))
    assert [r.correct for r in results] == [True, False] and ctx.graded == [["ok", "no"]]


def factory(max_turns):  # used by the import test below
    return RetryWithFeedback(max_turns=max_turns)


def test_episode_configs():
    assert isinstance(make_episode(SingleTurnConfig()), SingleTurn)
    ep = make_episode(RetryConfig(max_turns=4, discount=0.9))
    assert (ep.max_turns, ep.discount) == (4, 0.9)
    ep = make_episode(ImportedConfig(path="tests.unit.test_episodes:factory", options={"max_turns": 5}))
    assert isinstance(ep, RetryWithFeedback) and ep.max_turns == 5
    with pytest.raises(ValueError, match=r"episode.path 'no.such:thing'"):
        make_episode(ImportedConfig(path="no.such:thing"))
    with pytest.raises(ValueError):
        RetryConfig(max_turns=0)
