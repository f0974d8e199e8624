"""The discrete-event RL simulator (areal_core/sim): closed forms, monotonicity, the
weight-update modes, the staleness gate, bad input, calibration and the planner."""

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from areal_core.sim import GPUS, MODELS, Efficiency, LengthDist, SimConfig, build_cost_model, simulate
from areal_core.sim.calibrate import calibrate_from
from areal_core.sim.engine import resolve
from areal_core.sim.planner import format_plan, plan, recommend
from areal_core.sim.server import Request, RolloutServer
from areal_core.sim.validation import ValidationRow, format_validation

COST_7B = build_cost_model(MODELS["7B"], GPUS["H800"], 1)


def small(**changes) -> SimConfig:
    """A fast setting: 1.5B on H800s, 8 prompts x 4 answers, short heavy-tailed answers."""
    cfg = SimConfig(
        model="1.5B",
        gpu="H800",
        n_gpus=8,
        n_rollout_gpus=6,
        prompts_per_step=8,
        answers_per_prompt=4,
        prompt_tokens=128,
        lengths=LengthDist(max_new_tokens=2048, median=300, sigma=1.0),
        n_steps=12,
        warmup_steps=4,
        seed=1,
    )
    return replace(cfg, **changes)


def request(rid, target, prompt=100, group=0):
    return Request(rid=rid, group=group, prompt=prompt, target=target, admit_version=0)


def server(mode="reprefill", cost=COST_7B, max_running=1024, reserve=0):
    return RolloutServer(0, cost, 1, mode, max_running, reserve)


# ---- closed forms ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,ctx,steps", [(1, 100, 1), (1, 1000, 500), (64, 64_000, 300), (512, 5e4, 900), (300, 3e6, 77)]
)
def test_decode_span_is_the_sum_of_steps(batch, ctx, steps):
    brute = sum(COST_7B.decode_step_s(batch, ctx + batch * j) for j in range(steps))
    assert COST_7B.decode_span_s(batch, ctx, steps) == pytest.approx(brute, rel=1e-12)


def test_roofline_memory_bound_small_compute_bound_large():
    per_seq = [COST_7B.decode_step_s(b, b * 200) / b for b in (1, 8, 64, 512, 2048)]
    assert per_seq == sorted(per_seq, reverse=True)  # batching amortises the weight read
    step = [COST_7B.decode_step_s(b, b * 200) for b in (1, 2, 4)]
    assert step[2] - step[0] < 0.05 * step[0]  # memory-bound: the batch barely costs
    big = [COST_7B.decode_step_s(b, b * 200) for b in (2048, 4096)]
    assert big[1] == pytest.approx(2 * big[0] - COST_7B.decode_overhead_s, rel=1e-9)  # compute-bound: linear


def test_single_request_latency_is_prefill_plus_n_steps():
    s = server()
    s.submit(request(0, target=777, prompt=300))
    done, _ = s.touch(0.0)
    assert not done
    prefill = COST_7B.prefill_s(300, 300 * 300)
    decode = sum(COST_7B.decode_step_s(1, 300 + j) for j in range(777))
    t = s.next_event_time()
    assert t == pytest.approx(prefill + decode, rel=1e-12)
    done, _ = s.touch(t)
    assert [r.rid for r in done] == [0] and done[0].generated == 777 and s.generated_tokens == 777


def test_sync_step_time_constant_lengths_closed_form():
    cfg = SimConfig(
        model="1.5B",
        gpu="H800",
        n_gpus=2,
        mode="sync",
        prompts_per_step=2,
        answers_per_prompt=2,
        prompt_tokens=64,
        lengths=LengthDist.constant(500),
        n_steps=3,
        warmup_steps=1,
    )
    result = simulate(cfg)
    cost = resolve(cfg).cost
    # two servers, two answers each (one of each group: nothing shared), all start together
    gen = cost.prefill_s(2 * 64, 2 * 64**2) + cost.decode_span_s(2, 2 * 64, 500)
    train = cost.train_s(4 * 564, 4 * 564**2, 2) + cost.colocate_switch_s
    step = gen + train + cost.weight_update_s
    assert np.diff(np.r_[0.0, result.step_end_s]) == pytest.approx([step] * 3, rel=1e-9)
    assert result.effective_throughput == pytest.approx(4 * 564 / step, rel=1e-9)
    assert result.effective_answer_throughput == pytest.approx(4 * 500 / step, rel=1e-9)
    assert result.staleness_max == 0


def test_eta0_async_is_sync_like():
    cfg = small(eta=0, lengths=LengthDist.constant(400), n_rollout_gpus=4, prompts_per_step=4, answers_per_prompt=2)
    result = simulate(cfg)
    cost = resolve(cfg).cost
    assert result.staleness_max == 0 and result.staleness.size == cfg.n_steps * cfg.batch_size
    # one batch per version: generate, train, load, then the next batch is admitted
    gen = cost.prefill_s(2 * 128, 2 * 128**2) + cost.decode_span_s(2, 2 * 128, 400)
    train = cost.train_s(8 * 528, 8 * 528**2, 4)
    steps = np.diff(result.step_end_s)
    assert steps == pytest.approx([gen + train + cost.weight_update_s] * (cfg.n_steps - 1), rel=1e-9)


def test_a_groups_fresh_answers_prefill_their_prompt_once():
    s = server()
    for rid, group in enumerate((0, 0, 0, 1)):  # three answers to one prompt, one to another
        s.submit(request(rid, target=50, prompt=300, group=group))
    s.touch(0.0)
    assert s.batch == 4 and s.clock == pytest.approx(COST_7B.prefill_s(2 * 300, 2 * 300**2))


def test_one_server():
    result = simulate(small(n_gpus=2, n_rollout_gpus=1))
    assert result.n_rollout_gpus == 1 and result.n_trainer_gpus == 1
    assert result.trained_tokens > 0 and result.staleness_max <= 4


# ---- monotonicity ---------------------------------------------------------------------


def fast_trainer(cfg: SimConfig) -> SimConfig:
    """Training nearly free: throughput is set by generation alone."""
    cost = resolve(cfg).cost.with_(
        train_device_s_per_token=1e-9, train_device_s_per_token_sq=0.0, train_step_overhead_s=0.01
    )
    return replace(cfg, cost=cost)


def test_more_rollout_devices_never_lower_generation_throughput():
    throughputs = []
    for n_rollout in (1, 2, 3, 4, 6, 8):
        # 512 answers a batch: the servers, not the answers' latency, bound generation
        cfg = small(
            n_gpus=n_rollout + 2,
            n_rollout_gpus=n_rollout,
            eta=4,
            prompts_per_step=64,
            answers_per_prompt=8,
            n_steps=10,
            warmup_steps=3,
        )
        throughputs.append(simulate(fast_trainer(cfg)).generation_throughput)
    assert all(b >= a for a, b in pairwise(throughputs)), throughputs


def test_larger_eta_never_lowers_async_throughput_when_generation_bound():
    throughputs = [simulate(fast_trainer(small(eta=eta))).effective_throughput for eta in (0, 1, 2, 4, 8)]
    assert all(b >= a for a, b in pairwise(throughputs)), throughputs
    assert throughputs[-1] > 1.5 * throughputs[0]  # the long tail no longer stalls every step


def test_async_beats_sync_on_a_heavy_tail():
    cfg = small(n_gpus=16, n_rollout_gpus=12, lengths=LengthDist(max_new_tokens=8192, median=500, sigma=1.2))
    assert simulate(cfg).effective_throughput > simulate(replace(cfg, mode="sync")).effective_throughput


# ---- weight-update modes --------------------------------------------------------------


def running_server(mode):
    s = server(mode)
    s.submit(request(0, target=1000))
    s.submit(request(1, target=50))
    s.touch(0.0)
    return s


def update_mid_flight(mode):
    """Two answers in flight at 0.2 s, then version 1 arrives: (server, boundary time, steps so far,
    finished, confirmation time)."""
    s = running_server(mode)
    s.advance(0.2)
    boundary, steps = s.clock, s.steps
    done, confirmed = s.begin_update(1, 0.2)
    return s, boundary, steps, done, confirmed


def test_keep_kv_only_pauses_to_load():
    s, boundary, steps, done, confirmed = update_mid_flight("keep_kv")
    assert confirmed == pytest.approx(boundary + COST_7B.weight_update_s)
    assert s.clock == pytest.approx(confirmed) and s.version == 1
    assert s.batch == 2 and s.steps == steps and not done  # in-flight answers go on, KV kept
    assert all(r.first_version == 0 for r in s.running.values())


def test_reprefill_loads_then_recomputes_prompt_and_output():
    s, boundary, steps, _, confirmed = update_mid_flight("reprefill")
    assert confirmed == pytest.approx(boundary + COST_7B.weight_update_s)
    ctx = [100 + steps, 100 + steps]
    assert s.clock == pytest.approx(confirmed + COST_7B.prefill_s(sum(ctx), sum(c * c for c in ctx)))
    assert s.batch == 2 and s.version == 1


def test_drain_stops_admitting_and_loads_after_the_last_answer():
    s = running_server("drain")
    s.advance(0.2)
    _, confirmed = s.begin_update(1, 0.2)
    assert confirmed is None and s.version == 0
    s.submit(request(2, target=10))
    s.touch(s.clock)
    assert s.batch == 2 and len(s.queue) == 1  # nothing new starts while draining
    finished = []
    while confirmed is None:
        t = s.next_event_time()
        done, confirmed = s.touch(t)
        finished += [r.rid for r in done]
    assert finished == [1, 0]  # both in-flight answers ended on the old weights
    assert confirmed == pytest.approx(t + COST_7B.weight_update_s)
    assert s.version == 1 and s.batch == 1  # the queued request starts after the load, on the new weights
    assert s.running[2].first_version == 1


def test_modes_in_a_full_run():
    results = {m: simulate(small(weight_update=m)) for m in ("reprefill", "keep_kv", "drain")}
    for mode, result in results.items():
        assert result.weight_update == mode and result.staleness_max <= 4
        assert result.n_weight_updates == small().n_steps - 1


# ---- the gate (the simulator calls algo.staleness's) --------------------------------------


@pytest.mark.parametrize("eta", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("mode", ["reprefill", "keep_kv", "drain"])
def test_staleness_never_exceeds_eta(eta, mode):
    cfg = small(eta=eta, weight_update=mode, lengths=LengthDist(max_new_tokens=4096, median=200, sigma=1.5), n_steps=15)
    result = simulate(cfg)
    assert result.staleness.size == cfg.n_steps * cfg.batch_size
    assert result.staleness.min() >= 0 and result.staleness_max <= eta
    assert sum(result.staleness_histogram().values()) == result.staleness.size


def test_kv_pressure_retracts_but_the_run_completes():
    cfg = small(n_gpus=3, n_rollout_gpus=1, prompts_per_step=16, eta=3)
    cost = resolve(cfg).cost.with_(kv_capacity_tokens=3000)
    result = simulate(replace(cfg, cost=cost))
    assert result.n_retracted > 0 and result.staleness_max <= 3


# ---- outputs --------------------------------------------------------------------------


def test_outputs():
    cfg = small(util_bins=40)
    result = simulate(cfg)
    assert result.util_t.shape == result.rollout_busy.shape == result.trainer_busy.shape == (40,)
    assert np.all((result.rollout_busy >= 0) & (result.rollout_busy <= 1))
    assert 0 < result.trainer_util < 1 and 0 < result.rollout_util <= 1
    assert len(result.step_end_s) == cfg.n_steps and result.wall_time_s == result.step_end_s[-1]
    assert result.effective_throughput > 0 and set(result.summary()) >= {"effective_throughput", "staleness_max"}


# ---- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"n_rollout_gpus": 8}, "n_rollout_gpus"),  # no trainer device
        ({"n_rollout_gpus": 0}, "n_rollout_gpus"),  # no rollout device
        ({"model": "32B", "rollout_tp": 1}, "rollout_tp"),  # 65 GB of weights on one 80 GB device
        ({"model": "32B", "n_gpus": 8, "rollout_tp": 4, "n_rollout_gpus": 4}, "n_trainer_gpus"),  # 520 GB state
        ({"model": "32B", "mode": "sync", "n_gpus": 4, "rollout_tp": 4}, "n_gpus"),
        ({"mode": "both"}, "mode"),
        ({"weight_update": "hot"}, "weight_update"),
        ({"eta": -1}, "eta"),
        ({"warmup_steps": 12}, "warmup_steps"),
        ({"rollout_tp": 4}, "n_rollout_gpus"),  # 6 devices are not whole servers of 4
    ],
)
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        simulate(small(**changes))


def test_bad_lengths_name_the_field():
    with pytest.raises(ValueError, match=r"lengths.samples"):
        LengthDist.empirical([100, -3, 50], max_new_tokens=200)
    with pytest.raises(ValueError, match=r"lengths.median"):
        LengthDist(max_new_tokens=100, median=-5)
    with pytest.raises(ValueError, match=r"lengths.max_new_tokens"):
        LengthDist(max_new_tokens=0)


def test_empirical_lengths_are_clipped():
    dist = LengthDist.empirical([0, 10, 5000], max_new_tokens=1000)
    draws = dist.sample(np.random.default_rng(0), 300)
    assert set(draws) == {1, 10, 1000}


# ---- calibration ----------------------------------------------------------------------


def synthetic_measurements(truth, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)

    def jitter(x):
        return x * (1 + noise * rng.standard_normal())

    decode = [
        {"batch": b, "context_tokens": b * per, "step_s": jitter(truth.decode_step_s(b, b * per))}
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
        for per in (100, 1000, 4000)
    ]
    prefill = [
        {"tokens": n * k, "tokens_sq": n * n * k, "time_s": jitter(truth.prefill_s(n * k, n * n * k))}
        for n in (128, 512, 2048, 8192)
        for k in (1, 4)
    ]
    train = [
        {"tokens": n * k, "tokens_sq": n * n * k, "n_devices": d, "time_s": jitter(truth.train_s(n * k, n * n * k, d))}
        for n in (1000, 4000, 16000)
        for k in (4, 16)
        for d in (1, 8)
    ]
    return {
        "decode": decode,
        "prefill": prefill,
        "train": train,
        "weight_update_s": [truth.weight_update_s] * 3,
        "kv_capacity_tokens": truth.kv_capacity_tokens,
        "train_scaling_eff": truth.train_scaling_eff,
    }


FITTED = (
    "decode_overhead_s",
    "decode_weight_read_s",
    "decode_kv_read_s_per_token",
    "decode_flop_s_per_seq",
    "decode_flop_s_per_ctx_token",
    "prefill_overhead_s",
    "prefill_s_per_token",
    "prefill_s_per_token_sq",
    "train_device_s_per_token",
    "train_device_s_per_token_sq",
    "train_step_overhead_s",
    "weight_update_s",
)


def test_calibration_recovers_a_known_model():
    truth = build_cost_model(MODELS["7B"], GPUS["A100"], 2, Efficiency(decode_step_overhead_s=0.002))
    fit = calibrate_from(synthetic_measurements(truth))
    for name in FITTED:
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name
    assert fit.kv_capacity_tokens == truth.kv_capacity_tokens


def test_calibration_with_noise_predicts_within_a_few_percent():
    fit = calibrate_from(synthetic_measurements(COST_7B, noise=0.01, seed=3))
    for b, ctx in ((1, 500), (16, 64_000), (256, 1e6), (2048, 4e5)):
        assert fit.decode_step_s(b, ctx) == pytest.approx(COST_7B.decode_step_s(b, ctx), rel=0.05)
    assert fit.train_s(1e6, 4e9, 16) == pytest.approx(COST_7B.train_s(1e6, 4e9, 16), rel=0.05)


def test_calibration_of_a_compute_bound_machine():
    # a CPU: decode time grows with the batch from the start; no memory plane
    decode = [
        {"batch": b, "context_tokens": b * 50, "step_s": 0.001 + 0.0004 * b + 1e-7 * b * 50}
        for b in (1, 2, 4, 8, 16, 32)
    ]
    m = synthetic_measurements(COST_7B)
    fit = calibrate_from({**m, "decode": decode})
    assert fit.decode_step_s(10, 500) == pytest.approx(0.001 + 0.004 + 5e-5, rel=1e-6)


def test_calibration_fits_the_scaling_efficiency_when_not_given():
    truth = COST_7B.with_(train_scaling_eff=0.8)
    m = synthetic_measurements(truth)
    del m["train_scaling_eff"]
    fit = calibrate_from(m)
    assert fit.train_scaling_eff == pytest.approx(0.8, abs=0.003)
    assert fit.train_s(1e6, 4e9, 8) == pytest.approx(truth.train_s(1e6, 4e9, 8), rel=0.01)
    one_count = {**m, "train": [p for p in m["train"] if p["n_devices"] == 1]}
    assert calibrate_from(one_count).train_scaling_eff == 0.97  # nothing to fit it from


def test_calibration_input_errors():
    m = synthetic_measurements(COST_7B)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        calibrate_from({k: v for k, v in m.items() if k != "kv_capacity_tokens"})
    with pytest.raises(ValueError, match="step_s"):
        calibrate_from({**m, "decode": [{"batch": 1, "context_tokens": 10}]})


# ---- planner and validation table -----------------------------------------------------


def test_planner_ranks_and_recommends():
    alts = plan(
        "1.5B",
        "H800",
        8,
        LengthDist(max_new_tokens=2048, median=300, sigma=1.0),
        prompt_tokens=128,
        prompts_per_step=8,
        answers_per_prompt=4,
        etas=(1, 4),
        rollout_shares=(0.5, 0.75),
        n_steps=10,
        warmup_steps=3,
    )
    assert [a.throughput for a in alts] == sorted((a.throughput for a in alts), reverse=True)
    assert sum(a.mode == "sync" for a in alts) == 1 and len(alts) == 1 + 2 * 2
    assert all(a.staleness_max <= a.eta for a in alts)
    best = recommend(alts)
    assert best.throughput >= 0.95 * alts[0].throughput
    assert all(a.eta >= best.eta for a in alts if a.throughput >= 0.95 * alts[0].throughput)
    assert "vs sync" in format_plan(alts)


def test_planner_skips_splits_whose_trainer_cannot_hold_the_model():
    # 32B: 520 GB of training state needs 8 H800s; with 16 devices only 8:8 fits
    alts = plan(
        "32B",
        "H800",
        16,
        LengthDist(max_new_tokens=1024, median=200, sigma=0.5),
        prompts_per_step=4,
        answers_per_prompt=2,
        etas=(2,),
        rollout_shares=(0.5, 0.75),
        n_steps=4,
        warmup_steps=1,
    )
    assert {(a.mode, a.n_trainer_gpus) for a in alts} == {("sync", 16), ("async", 8)}


def test_validation_row_error_and_table():
    row = ValidationRow("x", published=2.0, simulated=2.5, source="s")
    assert row.rel_error == pytest.approx(0.25)
    assert "+25%" in format_validation([row])


# ---- this machine: measurement and the mapping of a run onto the simulator ------------


def test_measure_decode_times_the_engine():
    torch = pytest.importorskip("torch")
    from areal_core.experiment import load_config
    from areal_core.models import build_char_tokenizer, build_tiny
    from areal_core.rollout.config import SamplingConfig
    from areal_core.sim.measure import DECODE_CHUNK, DECODE_NEW, measure_decode

    torch.set_num_threads(1)
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml"))
    tok = build_char_tokenizer()
    points = measure_decode(
        build_tiny(cfg.model.tiny, tok, 0), SamplingConfig(temperature=1.0), len(tok), reps=1, batches=(1, 4)
    )
    assert len(points) == 2 * (DECODE_NEW // DECODE_CHUNK)
    assert all(0 < p["step_s"] < 1 for p in points)
    for b in (1, 4):  # the context grows by the batch every step
        ctx = [p["context_tokens"] for p in points if p["batch"] == b]
        assert np.diff(ctx) == pytest.approx([b * DECODE_CHUNK] * (len(ctx) - 1))


def run_facts(**changes):
    from areal_core.sim.local import RunFacts

    facts = RunFacts(
        run_dir="r",
        name="quickstart",
        eta=4,
        weight_update="reprefill",
        prompts_per_step=16,
        answers_per_prompt=8,
        steps=12,
        warmup_steps=2,
        max_new_tokens=96,
        prompt_tokens=9,
        answer_lengths=(10, 20, 40, 96),
        n_servers=1,
        rollout_threads=1,
        trainer_threads=1,
        max_running=256,
        measured_tokens_per_s=1000.0,
    )
    return replace(facts, **changes)


def test_a_run_maps_onto_cores():
    from areal_core.sim.local import predict, sim_config

    cost = calibrate_from(synthetic_measurements(COST_7B))
    asyn = sim_config(run_facts(), cost)
    assert (asyn.mode, asyn.n_gpus, asyn.n_rollout_gpus, asyn.rollout_tp) == ("async", 2, 1, 1)
    sync = sim_config(run_facts(eta=0, weight_update="drain", trainer_threads=2), cost)
    assert (sync.mode, sync.n_gpus, sync.rollout_tp) == ("sync", 2, 2)  # one server, then the trainer, on 2 cores
    assert resolve(sync).n_servers == 1 and resolve(sync).n_trainer_gpus == 2
    assert predict(run_facts(), cost, seeds=1)["simulated"] > 0


def test_repetitions_of_a_setting_are_one_row():
    from areal_core.sim.local import format_rows, group_repetitions

    a, b = run_facts(run_dir="rep0"), run_facts(run_dir="rep1", answer_lengths=(5,), measured_tokens_per_s=2000.0)
    other = run_facts(run_dir="rep0-sync", eta=0, weight_update="drain")
    assert group_repetitions([a, other, b]) == [[a, b], [other]]
    row = {
        "run": "quickstart",
        "mode": "async",
        "eta": 4,
        "steps": 12,
        "batch": "16 x 8",
        "answer_len_mean": 20.0,
        "measured": 1500.0,
        "measured_runs": [1000.0, 2000.0],
        "measured_std": 707.1,
        "simulated": 1800.0,
        "simulated_std": 10.0,
        "rel_error": 0.2,
        "rel_error_range": [-0.1, 0.8],
    }
    line = format_rows([row]).splitlines()[-1]
    assert "| 1,500 ± 707 (2) |" in line and "| +20.0% (-10%..+80%) |" in line
    assert "(" not in format_rows([{**row, "measured_runs": [1500.0]}]).splitlines()[-1].split("|")[-2]


def test_ratios_become_whole_servers():
    from areal_core.sim.request import parse_ratio, rollout_counts

    assert parse_ratio(" 3 : 1 ") == (3, 1)
    assert rollout_counts(64, 2, [(3, 1), (1, 1), (7, 1)]) == [32, 48, 56]
    with pytest.raises(ValueError, match="ratio: 1:0 leaves no trainer device"):
        rollout_counts(8, 1, [(1, 0)])
    with pytest.raises(ValueError, match="ratio: 1:15 leaves no rollout server"):
        rollout_counts(8, 2, [(1, 15)])
