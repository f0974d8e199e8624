"""The simulator's in-situ calibration (areal_core/sim/in_situ.py): what a run of the whole
system measures, and how the cost model is scaled by it."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from areal_core.sim.cost import CostModel, in_situ_cost
from areal_core.sim.engine import simulate
from areal_core.sim.in_situ import fit, measure_run, write_fit

# a CPU-core-like cost model, written out so the expected figures below are independent of any fit
COST = CostModel(
    decode_overhead_s=5e-4,
    decode_weight_read_s=0.0,
    decode_kv_read_s_per_token=0.0,
    decode_flop_s_per_seq=2e-5,
    decode_flop_s_per_ctx_token=3e-7,
    prefill_overhead_s=2e-3,
    prefill_s_per_token=2e-5,
    prefill_s_per_token_sq=0.0,
    kv_capacity_tokens=10**6,
    train_device_s_per_token=6e-5,
    train_device_s_per_token_sq=1e-8,
    train_step_overhead_s=0.02,
    train_scaling_eff=0.7,
    weight_update_s=1e-3,
)
ANSWERS = 4  # per prompt
PROMPTS = 2  # per step
STEPS = 5
WARMUP = 1


def sim_cfg(mode):
    from areal_core.sim.local import sim_config
    from tests.unit.test_sim import run_facts

    facts = run_facts(
        eta=4 if mode == "async" else 0,
        weight_update="reprefill" if mode == "async" else "drain",
        trainer_threads=1 if mode == "async" else 2,
        answer_lengths=(30,),
        max_new_tokens=30,
        prompts_per_step=PROMPTS,
        answers_per_prompt=ANSWERS,
    )
    return sim_config(facts, COST)


def fit_for(mode, train=1.5, overhead=0.004, generation=2.0, train_fixed=0.003, generation_fixed=0.05):
    return {
        "modes": {
            mode: {
                "train_slowdown": train,
                "train_fixed_s": train_fixed,
                "step_overhead_s": overhead,
                "generation_slowdown": generation,
                "generation_fixed_s": generation_fixed,
            }
        }
    }


def test_in_situ_cost_scales_training_and_generation_exactly():
    cfg = sim_cfg("sync")
    base = simulate(cfg)
    scaled = simulate(replace(cfg, cost=in_situ_cost(COST, fit_for("sync"), "sync")))
    # training: 1.5 x its cost alone + 3 ms + 4 ms per step
    assert scaled.step_train_s == pytest.approx(1.5 * base.step_train_s + 0.003 + 0.004)
    # generation (constant lengths, one server, eta 0): every decode step and prefill twice as long,
    # and 50 ms of fixed wait per step
    steps = lambda r: np.diff(np.concatenate([[0.0], r.step_end_s])) - r.step_train_s  # noqa: E731
    assert steps(scaled) == pytest.approx(2.0 * (steps(base) - COST.weight_update_s) + COST.weight_update_s + 0.05)
    assert (steps(base) - COST.weight_update_s).min() > 0


def test_in_situ_cost_needs_a_fit_for_the_mode():
    assert in_situ_cost(COST, None, "async") is COST
    with pytest.raises(ValueError, match="no 'async' runs"):
        in_situ_cost(COST, fit_for("sync"), "async")
    with pytest.raises(ValueError, match="slowdowns must be > 0"):
        in_situ_cost(COST, fit_for("sync", train=0.0), "sync")
    with pytest.raises(ValueError, match="fixed time comes out at"):
        in_situ_cost(COST, fit_for("sync", train_fixed=-1.0), "sync")
    with pytest.raises(ValueError, match="lacks"):
        in_situ_cost(COST, {"modes": {"sync": {"train_slowdown": 1.0}}}, "sync")


def write_run(folder, mode, train_factor, publish_s, wait_s, train_fixed=0.0, lengths=(5, 60)):
    """A finished run folder in the layout `areal-flow train` writes, with chosen timings."""
    from areal_core.experiment import load_config
    from areal_core.sim.local import _prompt_lengths

    base = json.loads(load_config("configs/quickstart.yaml").model_dump_json())
    base["data"]["synthetic"].update(n_train=20, n_eval=5)
    base["trainer"].update(
        batch_size=PROMPTS * ANSWERS, eta=4 if mode == "async" else 0, warmup_steps_for_throughput=WARMUP
    )
    base["rollout"].update(n_samples=ANSWERS, weight_update="reprefill" if mode == "async" else "drain")
    from areal_core.experiment import parse_config

    prompts = _prompt_lengths(parse_config(base, source="test"))
    ids = sorted(prompts)
    rng = np.random.default_rng(0)
    ledger, metrics, expected = [], [], {}
    for step in range(1, STEPS + 1):
        computed = sq = 0.0
        for g in range(PROMPTS):
            pid = ids[(step * PROMPTS + g) % len(ids)]
            computed += prompts[pid]  # the group's prompt, once
            for k in range(ANSWERS):
                n = int(rng.integers(*lengths))
                ledger.append({"trajectory_id": f"e0-p{pid}-s{k}", "step": step, "n_tokens": n})
                computed += n
                sq += (prompts[pid] + n) ** 2
        threads = 1 if mode == "async" else 2
        alone = COST.train_s(computed, sq, threads)
        expected[step] = alone
        metrics.append(
            {
                "step": step,
                "wait_time_s": wait_s,
                "publish_time_s": publish_s,
                "step_time_s": wait_s + publish_s + train_factor * alone + train_fixed,
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(base))
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "steps": STEPS,
                "trainer_torch_threads": 1 if mode == "async" else 2,
                "effective_train_tokens_per_s": 1000.0,
            }
        )
    )
    pd.DataFrame(ledger).to_parquet(folder / "ledger.parquet")
    pd.DataFrame(metrics).to_parquet(folder / "metrics.parquet")
    return expected


def test_measure_run_costs_each_step_with_its_own_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    expected = write_run(tmp_path / "async", "async", train_factor=1.3, publish_s=0.007, wait_s=0.01)
    r = measure_run(tmp_path / "async", COST)
    assert r["mode"] == "async" and r["steps_used"] == STEPS - WARMUP
    assert r["train_slowdown"] == pytest.approx(1.3)
    assert r["step_overhead_s"] == pytest.approx(0.007)
    assert r["train_s_alone"] == pytest.approx(np.mean([expected[s] for s in range(WARMUP + 1, STEPS + 1)]))
    assert "generation_slowdown" not in r  # an asynchronous run never waits on generation

    # a synchronous run: its generation phase against the simulated one; twice the wait, twice the ratio
    write_run(tmp_path / "sync1", "sync", train_factor=1.0, publish_s=0.002, wait_s=0.05)
    write_run(tmp_path / "sync2", "sync", train_factor=1.0, publish_s=0.002, wait_s=0.10)
    s1, s2 = measure_run(tmp_path / "sync1", COST), measure_run(tmp_path / "sync2", COST)
    assert s1["train_slowdown"] == pytest.approx(1.0)
    assert s1["generation_s_simulated"] > 0
    assert s2["generation_slowdown"] == pytest.approx(2 * s1["generation_slowdown"])

    both = fit([str(tmp_path / "sync1"), str(tmp_path / "async")], COST)
    assert both["modes"]["async"]["generation_slowdown"] == both["modes"]["sync"]["generation_slowdown"]
    assert both["modes"]["async"]["train_slowdown"] == pytest.approx(1.3)
    assert both["modes"]["async"]["train_fixed_s"] == pytest.approx(0.0, abs=1e-9)
    # one synchronous run: the generation ratio alone, no fixed part
    assert both["modes"]["sync"]["generation_fixed_s"] == 0.0
    assert both["modes"]["sync"]["generation_slowdown"] == pytest.approx(s1["generation_slowdown"])
    with pytest.raises(ValueError, match="no synchronous run"):
        fit([str(tmp_path / "async")], COST)

    # two synchronous settings with different answer lengths: generation = 1.5 x simulated + 20 ms, and
    # training = 1.2 x alone + 10 ms, recovered as such
    sims = {}
    for name, lengths in (("short", (5, 20)), ("long", (40, 90))):
        write_run(tmp_path / name, "sync", 1.0, 0.002, 0.0, lengths=lengths)
        sims[name] = measure_run(tmp_path / name, COST)["generation_s_simulated"]
        write_run(tmp_path / name, "sync", 1.2, 0.002, 1.5 * sims[name] + 0.02, train_fixed=0.01, lengths=lengths)
    assert sims["long"] > 2 * sims["short"]
    modes = fit([str(tmp_path / "short"), str(tmp_path / "long"), str(tmp_path / "async")], COST)["modes"]
    two = modes["sync"]
    # the asynchronous model takes the slowdown but overlaps the fixed wait
    assert modes["async"]["generation_slowdown"] == two["generation_slowdown"]
    assert modes["async"]["generation_fixed_s"] == 0.0
    assert two["generation_slowdown"] == pytest.approx(1.5, rel=1e-6)
    assert two["generation_fixed_s"] == pytest.approx(0.02, rel=1e-4)
    assert two["train_slowdown"] == pytest.approx(1.2, rel=1e-6)
    assert two["train_fixed_s"] == pytest.approx(0.01, rel=1e-4)

    calib = tmp_path / "calibration.json"
    calib.write_text(json.dumps({"fitted": {}, "points": [1, 2]}))
    write_fit(calib, both)
    data = json.loads(calib.read_text())
    assert data["points"] == [1, 2] and data["in_situ"]["modes"]["async"]["step_overhead_s"] == pytest.approx(0.007)


def test_prompts_of_a_saved_character_tokenizer_are_counted_as_the_run_encoded_them(tmp_path):
    """A model folder (the TRL-peer runs') with the character tokenizer: its prompts' spaces count."""
    from areal_core.experiment import parse_config
    from areal_core.models import build_char_tokenizer
    from areal_core.models.config import TinyArch
    from areal_core.models.tiny import build_tiny
    from areal_core.sim.local import _prompt_lengths

    tokenizer = build_char_tokenizer()  # saved beside a Qwen2 config.json, as bench/trl_peer.py saves it
    build_tiny(TinyArch(), tokenizer, 0).save_pretrained(str(tmp_path / "model"))
    tokenizer.save_pretrained(str(tmp_path / "model"))
    records = tmp_path / "arith.jsonl"
    records.write_text(
        "".join(
            json.dumps({"id": f"a-{i}", "task": "math", "prompt": f"Compute {i}-1+2 =", "answer": str(i + 1)}) + "\n"
            for i in range(8)
        )
    )
    data = {"dataset": str(records), "eval_dataset": str(records)}
    tiny = _prompt_lengths(parse_config({"name": "t", "model": {"name": "tiny"}, "data": data}, source="test"))
    saved = _prompt_lengths(
        parse_config({"name": "t", "model": {"name": str(tmp_path / "model")}, "data": data}, source="test")
    )
    assert saved == tiny
    assert min(tiny.values()) >= len("Compute 0-1+2 =")  # every character, spaces too, is a token
