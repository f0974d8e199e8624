"""Code through the training path: a code record's tests ride in its Prompt, the controller sends
them with each answer to the reward service, the sandbox runs them as Dask tasks, and the reward
follows reward.code_reward (all_pass, or the fraction of tests passed)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from areal_core.controller import ControllerSettings, Servers, group_id, prompt_of
from areal_core.controller.assemble import make_controller
from areal_core.data.records import Record
from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import grade_batch
from areal_core.reward.result import RewardResult
from areal_core.rollout.backend import Sampling
from areal_core.types import Prompt, Trajectory
from tests.scripted_controller import graded_batches

PROGRAM = "def f(x): return x*2"


def functional(pairs: list[tuple[int, int]]) -> list[dict]:
    return [
        {"testtype": "functional", "input": json.dumps(x), "output": json.dumps(y), "fn_name": "f"} for x, y in pairs
    ]


DOUBLES = functional([(0, 0), (1, 2), (5, 10), (-3, -6)])  # PROGRAM passes all four
HALF = functional([(0, 0), (1, 3), (5, 10), (-3, -7)])  # PROGRAM passes tests 0 and 2


def test_prompts_carry_the_records_tests():
    from areal_core.data.datasets import to_prompts
    from areal_core.models.tokenizer import build_char_tokenizer

    recs = [
        Record(id="c1", task="code", prompt="f(0)=0,f(1)=2\n", tests=DOUBLES),
        Record(id="m1", task="chain", prompt="a1b2=", answer="3", solution="a1=1,b2=3|3"),
    ]
    code, chain = to_prompts(recs, build_char_tokenizer())
    assert code.tests == DOUBLES and code.task == "code"
    assert chain.tests is None


def test_group_ids_name_their_prompt():
    assert prompt_of(group_id(3, "fn-train-000007")) == "fn-train-000007"
    assert prompt_of(group_id(0, "livecodebench_train/12")) == "livecodebench_train/12"
    assert prompt_of(group_id(12, "a-p-b")) == "a-p-b"  # a prompt id may itself hold "-p"


class _Recorder:
    """A reward service that records what it was sent and grades with ``results``."""

    def __init__(self, results):
        self.items, self.results = [], results

    def submit_batch(self, items, on_done):
        self.items.append(items)
        on_done([self.results(item) for item in items], None)


def _controller(prompts, rewards, reward_correct=5.0, reward_wrong=-5.0):
    from areal_core.controller.buffer import ReplayBuffer

    settings = ControllerSettings(
        batch_size=2,
        eta=0,
        n_samples=2,
        sampling=Sampling(max_new_tokens=8),
        reward_correct=reward_correct,
        reward_wrong=reward_wrong,
    )
    return make_controller(
        Servers(["http://127.0.0.1:1"]), prompts, lambda ids: PROGRAM, rewards, ReplayBuffer(), settings, transport=None
    )


def _group(prompt: Prompt, first: int) -> Iterator[Trajectory]:
    gid = group_id(0, prompt.id)
    for k in range(2):
        yield Trajectory(
            traj_id=f"{gid}-s{k}",
            group_id=gid,
            seq_no=first + k,
            admit_version=0,
            prompt_ids=[1],
            output_ids=[2, 3],
            finish_reason="stop",
            reference=prompt.reference,
            task=prompt.task,
        )


def test_controller_sends_each_groups_tests_and_shapes_the_reward():
    import asyncio

    prompts = [
        Prompt(id="p-a", task="code", input_ids=[1], reference="", tests=DOUBLES),
        Prompt(id="p-b", task="code", input_ids=[1], reference="", tests=HALF),
    ]
    scores = {id(DOUBLES): None, id(HALF): 0.5}  # all or nothing for one, half the tests for the other
    rec = _Recorder(lambda item: RewardResult(correct=item[3] is DOUBLES, score=scores[id(item[3])]))
    ctl = _controller(prompts, rec)
    ctl._loop = asyncio.new_event_loop()  # what start() runs the controller on
    try:
        for first, p in ((0, prompts[0]), (2, prompts[1])):
            ctl.buffer.admit(group_id(0, p.id), first, 0, 2)
            trajs = list(_group(p, first))
            results = ctl._loop.run_until_complete(ctl._grade(trajs, [PROGRAM] * 2))
            for t, r in zip(trajs, results):
                ctl._rewarded(t, r)
    finally:
        ctl._loop.close()
    assert [[item[3] for item in items] for items in rec.items] == [[DOUBLES, DOUBLES], [HALF, HALF]]
    assert all(item[1] == PROGRAM and item[0] == "code" for items in rec.items for item in items)
    a, b = (ctl.buffer.take(2, version=0, eta=4, timeout=5) for _ in range(2))
    assert [(t.correct, t.reward) for t in a] == [(True, 5.0)] * 2
    assert [(t.correct, t.reward) for t in b] == [(False, 0.0)] * 2  # halfway from -5 to +5
    assert b[0].reward_info["score"] == 0.5


class _Late:
    """A reward service whose grades arrive later, from another thread, when told to."""

    def __init__(self):
        self.pending = []

    def submit_batch(self, items, on_done):
        self.pending.append((items, on_done))


def test_a_grade_that_arrives_after_the_controller_stopped_is_dropped():
    import asyncio
    import threading

    prompts = [Prompt(id="p-a", task="code", input_ids=[1], reference="", tests=DOUBLES)]
    late = _Late()
    ctl = _controller(prompts, late)
    ctl._loop = asyncio.new_event_loop()
    ctl.buffer.admit(group_id(0, "p-a"), 0, 0, 2)
    fut = ctl._grade(list(_group(prompts[0], 0)), [PROGRAM] * 2)
    ctl._loop.close()  # what stop() leaves behind
    ctl._loop = None
    ((items, on_done),) = late.pending
    errors = []

    def deliver():  # the Dask client's thread
        try:
            on_done([RewardResult(correct=True)] * len(items), None)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    t = threading.Thread(target=deliver)
    t.start()
    t.join()
    assert errors == [] and not fut.done()  # dropped: nobody waits for it
    # while the loop runs, the same delivery settles the future (the control)
    ctl._loop = asyncio.new_event_loop()
    try:
        fut = ctl._grade(list(_group(prompts[0], 0)), [PROGRAM] * 2)
        ((items, on_done),) = late.pending[1:]
        threading.Thread(target=on_done, args=([RewardResult(correct=True)] * 2, None)).start()
        assert [r.correct for r in ctl._loop.run_until_complete(asyncio.wait_for(fut, 5))] == [True, True]
    finally:
        ctl._loop.close()


@pytest.mark.parametrize("code_reward,score", [("all_pass", None), ("fraction", 0.5)])
def test_grade_batch_runs_the_tests_in_the_sandbox(code_reward, score):
    passing, half = grade_batch([("code", PROGRAM, "", DOUBLES), ("code", PROGRAM, "", HALF)], 30.0, code_reward)
    assert passing.correct and passing.reason == "ok"
    assert (half.correct, half.reason, half.score) == (False, "test 1: wrong result", score)
    if code_reward == "fraction":
        assert passing.score == 1.0


def test_fraction_counts_every_test_and_stops_at_a_failure_of_no_single_test():
    [(r1, r2, r3)] = [
        grade_batch(
            [
                ("code", "```python\ndef f(x): return 0\n```", "", functional([(0, 0), (1, 0), (2, 1), (3, 0)])),
                (
                    "code",
                    "x = int(input())\nprint(x * 2 if x < 3 else -1)",
                    "",
                    [{"testtype": "stdin", "input": f"{x}\n", "output": f"{2 * x}\n"} for x in range(5)],
                ),
                ("code", "def f(x) return x", "", DOUBLES),  # does not load: nothing passes, one sandbox run
            ],
            30.0,
            "fraction",
        )
    ]
    assert (r1.correct, r1.score) == (False, 0.75)  # fails test 2 only: graded on after it
    assert (r2.correct, r2.score) == (False, 0.6)  # stdin: 0, 1, 2 pass; 3 and 4 fail
    assert (r3.correct, r3.score) == (False, 0.0) and "failed to load" in r3.reason


def test_a_code_answer_without_tests_is_an_error():
    with pytest.raises(ValueError, match="needs tests"):
        grade_batch([("code", PROGRAM, "", None)], 30.0)
    with pytest.raises(ValueError, match="code_reward"):
        grade_batch([("code", PROGRAM, "", DOUBLES)], 30.0, "most")


def test_reward_config_code_reward_is_typed():
    from pydantic import ValidationError

    assert RewardConfig().code_reward == "all_pass"
    assert RewardConfig(code_reward="fraction").code_reward == "fraction"
    with pytest.raises(ValidationError, match="code_reward"):
        RewardConfig(code_reward="partial")


@pytest.mark.slow
def test_generation_sandbox_reward_through_dask(tmp_path):
    """A real rollout server and a real Dask reward service: each group is graded against its own
    prompt's tests in the sandbox, in a Dask worker, with the fraction reward."""
    prompts = [
        Prompt(id="doubles", task="code", input_ids=[5, 6, 7], reference="", tests=DOUBLES),
        Prompt(id="half", task="code", input_ids=[5, 6, 8], reference="", tests=HALF),
    ]
    settings = ControllerSettings(
        batch_size=4,
        eta=0,
        n_samples=2,
        sampling=Sampling(max_new_tokens=6),
        reward_correct=1.0,
        reward_wrong=-1.0,
        shuffle=False,
    )
    # the model's answers are random tokens: every answer "is" PROGRAM, so each prompt's tests decide
    reward = RewardConfig(n_workers=1, code_reward="fraction")
    [batch], rewards = graded_batches(tmp_path, prompts, lambda ids: PROGRAM, settings, reward, 1, 8)
    by_prompt = {prompt_of(t.group_id): t for t in batch}
    assert (by_prompt["doubles"].correct, by_prompt["doubles"].reward) == (True, 1.0)
    half = by_prompt["half"]
    assert (half.correct, half.reward) == (False, 0.0)
    assert half.reward_info["reason"] == "test 1: wrong result" and half.reward_info["score"] == 0.5
    assert rewards.n_tasks >= 1
