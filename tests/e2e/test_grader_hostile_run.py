"""A run whose policy answers 10**400 once: the run goes on, and only that answer is graded wrong.

10**400 is an int no float holds: a grader that compares numbers through floats raises OverflowError on it, and an
error out of grading reaches the controller, which fails the whole run (``buffer.fail``). Here the answer goes
through the real grading path (the controller, the Dask reward service, the batched sandbox run, the host's
comparison) and must come back as one wrong verdict among right ones.

* ``test_one_huge_answer_is_one_wrong_verdict_and_the_run_goes_on``: a real rollout server (a tiny random model) and
  the controller's admission loop; its answers' text is scripted (``decode``), as test_code_training.py's is: the
  first answer graded returns 10**400, every other one is right. Several batches are taken after it.
* ``test_a_training_run_with_one_huge_answer_finishes`` (nightly): the code quickstart's task, shortened, through
  ``run_experiment``; one answer of one group is replaced by the 10**400 program where the controller hands its
  group to the reward service.
"""

from __future__ import annotations

import itertools
import json
import threading

import pytest

from areal_core.controller import ControllerSettings, prompt_of
from areal_core.reward.config import RewardConfig
from areal_core.rollout.backend import Sampling
from areal_core.types import Prompt
from tests.scripted_controller import graded_batches

RIGHT = "```python\ndef f(x):\n    return x * 2\n```"
HUGE = "```python\ndef f(x):\n    return 10**400\n```"
DOUBLES = [
    {"testtype": "functional", "input": json.dumps(x), "output": json.dumps(2 * x), "fn_name": "f"}
    for x in (0, 1, 5, -3)
]


class _Scripted:
    """The answers' text: HUGE for the first answer decoded, RIGHT for every other (thread-safe)."""

    def __init__(self):
        self.count = itertools.count()
        self.lock = threading.Lock()

    def __call__(self, ids) -> str:
        with self.lock:
            return HUGE if next(self.count) == 0 else RIGHT


@pytest.mark.slow
def test_one_huge_answer_is_one_wrong_verdict_and_the_run_goes_on(tmp_path):
    prompts = [Prompt(id=f"p{k}", task="code", input_ids=[5, 6, 7 + k], reference="", tests=DOUBLES) for k in range(3)]
    settings = ControllerSettings(
        batch_size=4,
        eta=2,  # three batches of answers may be admitted before the (absent) trainer's first step
        n_samples=4,
        sampling=Sampling(max_new_tokens=6),
        reward_correct=1.0,
        reward_wrong=-1.0,
        shuffle=False,
    )
    # groups after the huge answer's too
    batches, rewards = graded_batches(tmp_path, prompts, _Scripted(), settings, RewardConfig(n_workers=1), 3, 16)
    trajs = [t for batch in batches for t in batch]
    wrong = [t for t in trajs if not t.correct]
    assert len(trajs) == 12 and len(wrong) == 1, [(t.traj_id, t.reward_info.get("reason")) for t in trajs]
    (huge,) = wrong
    assert huge.reward == -1.0 and huge.reward_info["reason"] == "test 0: wrong result", huge.reward_info
    assert "10**400" in huge.reward_info["parsed"]
    same_group = [t for t in trajs if t.group_id == huge.group_id and t is not huge]
    assert len(same_group) == 3 and all(t.correct and t.reward == 1.0 for t in same_group)
    assert {prompt_of(t.group_id) for t in trajs} <= {"p0", "p1", "p2"}
    assert rewards.n_failed == 0  # graded, not failed: the comparison itself said wrong


@pytest.mark.slow
@pytest.mark.nightly
def test_a_training_run_with_one_huge_answer_finishes(tmp_path, warm_cache, monkeypatch):
    from areal_core.experiment import load_config
    from areal_core.reward.service import RewardService
    from areal_core.run.setup import run_experiment

    seen: list = []
    injected = threading.Event()
    real = RewardService.submit_batch

    def submit_batch(self, items, on_done):
        """The controller's call: one answer of the first code group becomes the 10**400 program, and what the
        service answers for that group is recorded."""
        if injected.is_set() or items[0][0] != "code":
            return real(self, items, on_done)
        injected.set()
        items = [(items[0][0], HUGE.replace("f(x)", f"{items[0][3][0]['fn_name']}(*args)"), *items[0][2:]), *items[1:]]

        def record(results, error):
            seen.append((items, results, error))
            on_done(results, error)

        return real(self, items, record)

    monkeypatch.setattr(RewardService, "submit_batch", submit_batch)
    cfg = load_config(
        "configs/code_quickstart.yaml",
        {
            "data.synthetic.n_train": 400,
            "data.synthetic.n_eval": 32,
            "data.synthetic.max_args": 2,
            "model.warm_start.steps": 20,
            "model.warm_start.batch_size": 16,
            "model.warm_start.val_problems": 32,
            "trainer.max_steps": 3,
            "trainer.batch_size": 16,
            "rollout.n_samples": 4,
            "rollout.sampling.max_new_tokens": 48,
            "reward.n_workers": 1,
            "eval.n_problems": 16,
        },
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["steps"] == 3 and summary["ledger_check"]["ok"], summary["ledger_check"]
    ((items, results, error),) = seen
    assert error is None and len(results) == len(items) == 4
    assert results[0].correct is False and results[0].reason == "test 0: wrong result", results[0]
    assert all(not r.reason.startswith("grading failed") for r in results)
