"""Prompt samplers: the plain shuffled stream and the pass-rate curriculum, alone and in the controller."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from areal_core.controller.prompt_sampling import BucketCurriculum, PromptStream, describe_mix
from areal_core.rollout.backend import Sampling


def _prompts(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=f"p{i}") for i in range(n)]


def test_prompt_stream_is_the_seeded_permutation_per_epoch():
    prompts = _prompts(7)
    stream = PromptStream(prompts, shuffle=True, seed=3)
    got = [stream.next() for _ in range(21)]
    for epoch in range(3):
        order = list(range(7))
        random.Random(3 * 1_000_003 + epoch).shuffle(order)  # the documented order, computed here
        assert got[7 * epoch : 7 * epoch + 7] == [(epoch, prompts[i]) for i in order]
    plain = PromptStream(prompts, shuffle=False, seed=3)
    assert [plain.next()[1].id for _ in range(9)] == [f"p{i}" for i in (0, 1, 2, 3, 4, 5, 6, 0, 1)]


def test_prompt_stream_restarts_from_its_state():
    prompts = _prompts(5)
    a = PromptStream(prompts, True, 1)
    for _ in range(8):
        a.next()
    b = PromptStream(prompts, True, 1, state=a.state())
    assert [a.next() for _ in range(6)] == [b.next() for _ in range(6)]


def _curriculum(sizes: dict[str, int], **kw) -> tuple[BucketCurriculum, list]:
    prompts, buckets = [], []
    for b, n in sizes.items():
        for i in range(n):
            prompts.append(SimpleNamespace(id=f"{b}-{i}"))
            buckets.append(b)
    return BucketCurriculum(prompts, buckets, seed=0, **kw), prompts


def test_curriculum_before_any_result_follows_the_data_mix():
    cur, _ = _curriculum({"2": 60, "3": 30, "10": 10})
    assert cur.names == ["2", "3", "10"]  # numeric order
    counts = Counter(cur.next()[1].id.split("-")[0] for _ in range(6000))
    for b, share in (("2", 0.6), ("3", 0.3), ("10", 0.1)):
        assert abs(counts[b] / 6000 - share) < 0.03, counts


def test_curriculum_moves_to_the_buckets_with_mixed_results():
    cur, _ = _curriculum({"easy": 50, "mixed": 25, "hard": 25}, ema=0.5, floor=0.02)
    for _ in range(30):  # "easy" always right, "hard" always wrong, "mixed" half right
        cur.observe("easy-0", 8, 8)
        cur.observe("hard-0", 0, 8)
        cur.observe("mixed-0", 4, 8)
    p = cur.estimates()
    assert p["easy"] == pytest.approx(1.0, abs=1e-6) and p["hard"] == pytest.approx(0.0, abs=1e-6)
    assert p["mixed"] == pytest.approx(0.5)
    # expected shares, computed independently: share * max(p(1-p), floor)
    w = {"easy": 0.5 * 0.02, "mixed": 0.25 * 0.25, "hard": 0.25 * 0.02}
    assert cur.mix() == pytest.approx({b: x / sum(w.values()) for b, x in w.items()})  # what the console shows
    counts = Counter(cur.next()[1].id.split("-")[0] for _ in range(8000))
    for b in w:
        assert abs(counts[b] / 8000 - w[b] / sum(w.values())) < 0.02, (counts, w)
    assert describe_mix(cur.mix(), "level", top=2).startswith("level=mixed 81%, level=")


def test_mix_without_a_curriculum_is_empty():
    assert PromptStream(_prompts(3), True, 0).mix() == {}


def test_curriculum_running_pass_rate_is_an_exponential_average():
    cur, _ = _curriculum({"a": 3}, ema=0.25)
    ref = 0.5
    for correct in (8, 0, 2, 6, 8):
        cur.observe("a-1", correct, 8)
        ref = 0.75 * ref + 0.25 * correct / 8
    assert cur.estimates()["a"] == pytest.approx(ref)


def test_curriculum_visits_every_prompt_of_a_bucket_once_per_epoch():
    cur, _prompts = _curriculum({"x": 4, "y": 6})
    seen: dict[tuple[str, int], list[str]] = {}
    for _ in range(200):
        epoch, p = cur.next()
        seen.setdefault((p.id[0], epoch), []).append(p.id)
    for (b, epoch), ids in seen.items():
        size = 4 if b == "x" else 6
        assert len(ids) == len(set(ids)) <= size  # no repeat within an epoch of its bucket
        if (b, epoch + 1) in seen:
            assert len(ids) == size  # a finished epoch covered the whole bucket


def test_curriculum_restarts_from_its_state():
    a, _ = _curriculum({"2": 20, "5": 10, "9": 5})
    first = []
    for i in range(40):
        first.append(a.next())
        a.observe(first[-1][1].id, i % 9, 8)
    b, _ = _curriculum({"2": 20, "5": 10, "9": 5})
    b = BucketCurriculum(b.prompts, [p.id.split("-")[0] for p in b.prompts], seed=0, state=a.state())
    for i in range(30):
        x, y = a.next(), b.next()
        assert (x[0], x[1].id) == (y[0], y[1].id)
        a.observe(x[1].id, i % 3, 8)
        b.observe(y[1].id, i % 3, 8)
    assert a.state() == b.state()


def test_curriculum_rejects_bad_settings_and_results():
    with pytest.raises(ValueError, match="floor"):
        _curriculum({"a": 2}, floor=0.3)
    with pytest.raises(ValueError, match="ema"):
        _curriculum({"a": 2}, ema=0.0)
    cur, _ = _curriculum({"a": 2})
    with pytest.raises(ValueError, match="cannot have 9 correct"):
        cur.observe("a-0", 9, 8)


def test_curriculum_names_a_record_without_the_field():
    from areal_core.data.datasets import bucket
    from areal_core.data.records import Record

    rec = Record(id="math-17", task="math", prompt="1+1?", answer="2", meta={"subject": "algebra"})
    with pytest.raises(
        ValueError, match=r"record math-17 has no meta field 'level' \(its meta fields: \['subject'\]\)"
    ):
        bucket(rec, "level")
    assert bucket(Record(id="c", task="chain", prompt="a1=", answer="1", meta={"k": 2}), "k") == "2"


class _ByReference:
    """Grades at once: reference 'easy' is always right, 'hard' never, 'mixed' every other time."""

    def __init__(self):
        self.n_mixed = 0

    def grade(self, text, reference):
        from areal_core.reward.result import RewardResult

        if reference == "mixed":
            self.n_mixed += 1
        correct = reference == "easy" or (reference == "mixed" and self.n_mixed % 2 == 0)
        return RewardResult(correct=correct, parsed=text, reason="test")

    def submit_batch(self, items, on_done):
        on_done([self.grade(text, reference) for _, text, reference, _ in items], None)


def test_controller_feeds_group_results_to_the_curriculum_and_saves_them():
    """Scripted servers (tests/fake_servers.py): what is tested is the controller's bookkeeping, not
    generation; the grades follow each prompt's kind."""
    from areal_core.controller import ControllerSettings, Servers
    from areal_core.controller.assemble import make_controller
    from areal_core.controller.buffer import ReplayBuffer
    from areal_core.types import Prompt
    from tests.fake_servers import RecordingTransport, scripted_servers

    prompts = [
        Prompt(id=f"{kind}{i}", task="chain", input_ids=[5, 6, i], reference=kind, bucket=kind)
        for kind in ("easy", "mixed", "hard")
        for i in range(10)
    ]
    settings = ControllerSettings(
        batch_size=8,
        eta=0,
        n_samples=2,
        sampling=Sampling(max_new_tokens=2, ignore_eos=True),
        reward_correct=1.0,
        reward_wrong=-1.0,
        curriculum={"ema": 0.5, "floor": 0.02},
    )
    buffer, transport = ReplayBuffer(), RecordingTransport()
    servers, make_client = scripted_servers()
    controller = make_controller(
        Servers(["http://a:1"], make_client=make_client),
        prompts,
        lambda ids: "",
        _ByReference(),
        buffer,
        settings,
        transport,
        version=0,
    )
    controller.start()
    try:
        taken = []
        for v in range(12):
            taken += buffer.take(8, version=v, eta=0, timeout=60)
            transport.stage(None, v + 1)
            controller.update_weights(v + 1).result(timeout=60)
        snap = controller.snapshot()
        rates = controller.pass_rates()
    finally:
        controller.stop()
    assert len(servers["http://a:1"].prompts) >= 12 * 8 and len(transport.pushed_to) == 12
    assert rates["easy"] > 0.9 and rates["hard"] < 0.1
    kinds = Counter(t.reference for t in taken[len(taken) // 2 :])
    assert kinds["mixed"] > kinds["easy"] + kinds["hard"], kinds  # the mix moved to where results differ
    assert snap["sampler"]["pass_rate"] == pytest.approx(rates)
    assert snap["sampler"]["n_drawn"] == snap["n_groups"]
    for gid, (prompt_id, correct, done) in snap["tally"].items():
        assert gid.endswith(f"-p{prompt_id}") and 0 <= correct <= done < 2
    # a restored controller starts from the saved pass rates, positions and tallies
    again = make_controller(
        Servers(["http://127.0.0.1:9"]),
        prompts,
        lambda ids: "",
        _ByReference(),
        ReplayBuffer(),
        settings,
        RecordingTransport(),
        version=snap["version"],
    )
    again.restore(snap)
    assert again.pass_rates() == pytest.approx(rates)
    assert again.admission.sampler.state() == snap["sampler"] and again.admission.tally == snap["tally"]


def test_a_deterministic_curriculum_reports_what_was_trained_whatever_finished_first():
    """Deterministic mode: the sampler learns a wave's groups when a later wave is drawn, which follows
    timing; its report as of "the first k trajectories trained" must not. Two admissions that saw the
    same groups finish in opposite orders, one having drawn the next wave already, report alike."""
    from areal_core.controller.admission import Admission
    from areal_core.controller.settings import ControllerSettings
    from areal_core.types import Prompt, Trajectory

    prompts = [Prompt(id=f"{b}{i}", task="t", input_ids=[1], reference="", bucket=b) for b in "xyz" for i in range(6)]
    settings = ControllerSettings(
        batch_size=4,
        eta=0,
        n_samples=2,
        sampling=Sampling(max_new_tokens=2),
        reward_correct=1.0,
        reward_wrong=-1.0,
        curriculum={"ema": 0.5, "floor": 0.02},
        deterministic=True,
    )

    def admitted(order: list[int], draw_next: bool) -> Admission:
        adm = Admission(prompts, settings, version=0)
        groups = []
        for _ in range(2):  # wave 0: two groups of two answers
            gid, _p = adm.draw(trainable=True)
            groups.append((gid, adm.n_submitted))
            adm.n_submitted += 2
        for g in order:  # the groups finish in this order, one right and one wrong answer each time g = 0
            gid, first = groups[g]
            for k in range(2):
                adm.count(
                    Trajectory(
                        traj_id=f"{gid}-s{k}",
                        group_id=gid,
                        seq_no=first + k,
                        admit_version=0,
                        prompt_ids=[1],
                        correct=(g == 0 and k == 0),
                    )
                )
        if draw_next:  # the next wave drawn already: the sampler itself has learned wave 0 now
            adm.draw(trainable=True)
        return adm

    a, b = admitted([0, 1], draw_next=False), admitted([1, 0], draw_next=True)
    assert a.sampler.estimates() != b.sampler.estimates()  # what the sampler itself holds follows timing
    assert a.settled(4).estimates() == b.settled(4).estimates() != a.settled(0).estimates()
    assert a.settled(4).mix() == b.settled(4).mix()
    assert a.sampler.state() == admitted([0, 1], draw_next=False).sampler.state()  # a report changes nothing
