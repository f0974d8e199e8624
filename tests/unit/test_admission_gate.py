"""The staleness gate's ``held`` flag (controller/admission.py), which core lending reads: true exactly
while admission waits at the gate for the next version."""

from __future__ import annotations

import asyncio

from areal_core.controller.admission import Admission
from areal_core.controller.settings import ControllerSettings
from areal_core.rollout.backend import Sampling
from areal_core.types import Prompt


def test_held_while_admission_waits_for_the_next_version():
    prompts = [Prompt(id=f"p{i}", task="t", input_ids=[1], reference="") for i in range(4)]
    settings = ControllerSettings(
        batch_size=4, eta=0, n_samples=2, sampling=Sampling(max_new_tokens=2), reward_correct=1.0, reward_wrong=-1.0
    )

    async def scenario() -> list[bool]:
        adm = Admission(prompts, settings, version=0)
        seen = [adm.held]
        await adm.wait()  # the first group: the gate is open
        adm.n_submitted = 4  # version 0's whole batch admitted (eta 0): the next group waits
        seen.append(adm.held)
        waiter = asyncio.create_task(adm.wait())
        await asyncio.sleep(0.05)
        seen += [waiter.done(), adm.held]
        await adm.advance(1)
        await asyncio.wait_for(waiter, 5)
        seen.append(adm.held)
        assert adm.gate_wait_s >= 0.04
        return seen

    assert asyncio.run(scenario()) == [False, False, False, True, False]


def test_a_cancelled_wait_leaves_the_gate_not_held():
    """A controller stopping while admission waits cancels the wait: the flag must not stay set."""
    prompts = [Prompt(id="p", task="t", input_ids=[1], reference="")]
    settings = ControllerSettings(
        batch_size=2, eta=0, n_samples=2, sampling=Sampling(max_new_tokens=2), reward_correct=1.0, reward_wrong=-1.0
    )

    async def scenario() -> tuple[bool, bool]:
        adm = Admission(prompts, settings, version=0)
        adm.n_submitted = 2
        waiter = asyncio.create_task(adm.wait())
        await asyncio.sleep(0.02)
        before = adm.held
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return before, adm.held

    assert asyncio.run(scenario()) == (True, False)
