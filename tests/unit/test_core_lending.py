"""Core lending (trainer/core_lending.py): the trainer computes on the servers' cores exactly while
they have no request, forward and backward, and gets its own share back afterwards."""

from pathlib import Path

import pytest
import torch

from areal_core.experiment import load_config
from areal_core.numerics import thread_invariant
from areal_core.trainer.core_lending import CoreLending, lent_threads

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
CPU = torch.device("cpu")


@pytest.fixture
def own_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _record_threads(model, seen: dict):
    """Record the thread count each linear layer's forward and its weight gradient ran under (hooks
    registered after the lending's, so they see what it set)."""

    def note(key) -> None:  # (a hook that returns something replaces the input or gradient)
        seen.setdefault(key, torch.get_num_threads())

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda *_, n=name: note(("fwd", n)))
            m.weight.register_hook(lambda g, n=name: note(("bwd", n)))


@pytest.mark.parametrize("busy_forward,busy_backward", [(False, False), (False, True), (True, False), (True, True)])
def test_threads_follow_the_servers_forward_and_backward(own_threads, busy_forward, busy_backward):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    busy = {"now": busy_forward}
    lending = CoreLending(lambda: busy["now"], base=1, lent=3, min_idle_share=0.0)
    seen: dict = {}
    with lending.installed(model):
        _record_threads(model, seen)
        loss = model(torch.randn(5, 8)).square().sum()
        busy["now"] = busy_backward
        loss.backward()
        shares = lending.end_step()
    expect_fwd, expect_bwd = (1 if busy_forward else 4), (1 if busy_backward else 4)
    assert {k: v for k, v in seen.items() if k[0] == "fwd"} == {("fwd", "0"): expect_fwd, ("fwd", "2"): expect_fwd}
    assert {k: v for k, v in seen.items() if k[0] == "bwd"} == {("bwd", "0"): expect_bwd, ("bwd", "2"): expect_bwd}
    idle = ((not busy_forward) * 2 + (not busy_backward) * 2) / 4  # two layers, each way once
    assert shares.idle == idle and shares.lent == idle
    assert torch.get_num_threads() == 1  # its own share back once unhooked
    assert lending.end_step() is None  # nothing since the last call


def test_unhooked_model_computes_as_before(own_threads):
    model = torch.nn.Linear(4, 4)
    lending = CoreLending(lambda: False, base=1, lent=1, min_idle_share=0.5)
    with lending.installed(model):
        model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    assert lending.end_step().lent == 1.0  # the pass inside the block only
    with pytest.raises(ValueError, match="no linear layer"):
        CoreLending(lambda: False, base=1, lent=1, min_idle_share=0.5).install(torch.nn.Tanh())
    with pytest.raises(ValueError, match="lent >= 1"):
        CoreLending(lambda: False, base=1, lent=0, min_idle_share=0.5)
    with pytest.raises(ValueError, match=r"min_idle_share must be in \[0, 1\], got 1.5"):
        CoreLending(lambda: False, base=1, lent=1, min_idle_share=1.5)


def test_a_copy_of_a_hooked_model_shares_the_lending_and_goes_quiet_with_it(own_threads):
    import copy
    import threading

    class Controller:  # ``busy`` is a controller's method, and a controller holds locks: no deepcopy
        def __init__(self):
            self.lock = threading.Lock()

        def generating(self) -> bool:
            with self.lock:
                return False

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    lending = CoreLending(Controller().generating, base=1, lent=2, min_idle_share=0.5)
    x = torch.randn(3, 4)
    with lending.installed(model):
        twin = copy.deepcopy(model)
        assert torch.equal(twin(x), model(x))
        assert lending.end_step().lent == 1.0 and lending.borrowed == 0  # the twin's two layers counted too
        twin(x)
        assert torch.get_num_threads() == 3  # the last pass borrowed ...
        assert lending.end_step().lent == 1.0 and torch.get_num_threads() == 1  # ... and between steps, its own
    assert torch.get_num_threads() == 1
    twin(x)  # its hooks outlive the handles but do nothing any more
    assert lending.checks == 0 and torch.get_num_threads() == 1


def test_a_step_borrows_only_after_a_step_whose_servers_were_idle_long_enough(own_threads):
    """The servers idle in a quarter of a step's layer passes: the next step computes on its own
    threads alone, idle servers or not, and still counts them; idle in half of them: it borrows again."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    pattern: list[bool] = []  # busy() answers, one per layer pass, in order
    lending = CoreLending(lambda: pattern.pop(0), base=1, lent=1, min_idle_share=0.5)
    seen: dict = {}

    def step(busy: list[bool]) -> tuple:
        pattern[:] = busy
        seen.clear()
        model(torch.randn(3, 4)).sum().backward()  # 3 forward + 3 backward passes
        assert not pattern
        return lending.end_step(), sorted(v for k, v in seen.items() if k[0] == "fwd")

    with lending.installed(model):
        _record_threads(model, seen)
        first, threads = step([False, True, True, True, True, True])  # idle 1 of 6: borrowed there
        assert (first.idle, first.lent) == (1 / 6, 1 / 6) and threads == [1, 1, 2]
        second, threads = step([False, False, False, True, True, True])  # idle 3 of 6, not borrowed
        assert (second.idle, second.lent) == (0.5, 0.0) and threads == [1, 1, 1]
        third, threads = step([False] * 6)  # the step before was idle in half its passes: borrows
        assert (third.idle, third.lent) == (1.0, 1.0) and threads == [2, 2, 2]
        assert lending.end_step() is None and lending.borrowing  # (no pass: the decision stands)


def test_a_steps_seconds_are_split_by_the_threads_each_pass_ran_on(own_threads):
    """Each pass counts from its start to the next pass's, the last one to the step's end; the time
    before the first pass counts in neither. The clock moves by a given amount at each reading."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    pattern: list[bool] = []  # busy() answers, one per layer pass, in order
    now = {"t": 0.0}

    def clock() -> float:
        now["t"] += step_of.pop(0)
        return now["t"]

    step_of: list[float] = []  # what each clock reading adds: the passes' durations, in order
    lending = CoreLending(lambda: pattern.pop(0), base=1, lent=1, min_idle_share=0.0, clock=clock)
    with lending.installed(model):
        # passes: fwd 0 (busy), fwd 1 (idle), bwd 1 (idle), bwd 0 (busy); readings at each pass and at the end
        pattern[:] = [True, False, False, True]
        step_of[:] = [5.0, 1.0, 2.0, 4.0, 8.0]  # 5 s before the first pass: counted in neither
        model(torch.randn(3, 4)).sum().backward()
        shares = lending.end_step()
        assert not pattern and not step_of
        assert (shares.own_s, shares.lent_s) == (1.0 + 8.0, 2.0 + 4.0)  # fwd 0 and bwd 0 own, the others lent
        assert (shares.idle, shares.lent) == (0.5, 0.5)
        pattern[:] = [False] * 4
        step_of[:] = [3.0, 1.0, 1.0, 1.0, 1.0]  # the next step starts afresh: nothing carried over
        model(torch.randn(3, 4)).sum().backward()
        shares = lending.end_step()
        assert (shares.own_s, shares.lent_s) == (0.0, 4.0)
    assert lending.end_step() is None


def test_the_servers_threads_are_lent_only_where_the_default_split_gave_them_away():
    from areal_core.run.setup import trainer_torch_threads

    def lent(sets: dict, cores: int, device=CPU, dtype=torch.float32) -> int:
        cfg = load_config(QUICKSTART, {"trainer.lend_idle_cores": True, **sets})
        return lent_threads(cfg, trainer_torch_threads(cfg, cores), cores, device, dtype)

    assert lent({}, 2) == 1  # asynchronous, one server of one thread: its core
    assert lent({"rollout.n_servers": 2, "rollout.torch_threads": 2}, 8) == 4
    assert lent({"trainer.eta": 0, "rollout.weight_update": "drain"}, 8) == 0  # sync: every core already
    assert lent({"trainer.torch_threads": 1}, 2) == 0  # a share set by hand is kept
    assert lent({"trainer.lend_idle_cores": False}, 2) == 0
    assert lent({}, 2, torch.device("cuda")) == 0  # a GPU trainer's threads are not its compute
    # by default only where the thread count changes no bit of the trainer's arithmetic; asked for, always
    for dtype in (torch.float32, torch.bfloat16):
        invariant = thread_invariant(dtype)[0]
        assert lent({"trainer.lend_idle_cores": None}, 2, dtype=dtype) == (1 if invariant else 0)
    assert lent({"trainer.lend_idle_cores": True}, 2, dtype=torch.float32) == 1


def test_idle_servers_held_at_the_gate_lend_whatever_the_last_steps_share(own_threads):
    """After a step whose servers were idle in too few passes, the next step borrows only in the
    passes that find them idle with admission held at the staleness gate; idle but not held, or held
    but still generating, it computes on its own thread."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    busy: list[bool] = []  # busy() answers, one per layer pass, in order
    held: list[bool] = []  # held() answers, asked only in passes that find the servers idle
    lending = CoreLending(lambda: busy.pop(0), base=1, lent=1, min_idle_share=0.5, held=lambda: held.pop(0))
    seen: dict = {}
    with lending.installed(model):
        _record_threads(model, seen)
        lending.borrowing = False  # as after a step whose servers were idle in under half its passes
        busy[:] = [True, False, False, False]  # fwd 0, fwd 1, bwd 1, bwd 0
        held[:] = [False, True, True]
        model(torch.randn(3, 4)).sum().backward()
        assert not busy and not held
        assert (seen[("fwd", "0")], seen[("fwd", "1")], seen[("bwd", "1")], seen[("bwd", "0")]) == (1, 1, 2, 2)
        shares = lending.end_step()
        assert (shares.idle, shares.lent) == (0.75, 0.5)
        assert torch.get_num_threads() == 1
