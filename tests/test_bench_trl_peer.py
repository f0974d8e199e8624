"""The TRL peer benchmark's own pieces (not its timings): problems, records, reward rules, throughput, config."""

from __future__ import annotations

import re

import pytest

from areal_core.data.records import read_records
from areal_core.models.tokenizer import UNK, build_char_tokenizer
from areal_core.reward.math import extract_final_answer
from bench import trl_peer
from bench.trl_worker import exact_integer_reward, final_answer

PROMPT = re.compile(r"^Compute (\d(?:[+*-]\d){2,3}) =$")


def test_problems_are_evaluated_with_operator_precedence():
    import random

    rng = random.Random(7)
    for _ in range(300):
        prompt, value = trl_peer.arithmetic_problem(rng)
        m = PROMPT.match(prompt)
        assert m, prompt
        assert value == eval(m.group(1), {"__builtins__": {}})  # Python's own precedence: the reference


def test_records_file_is_deterministic_math_and_in_the_tokenizer(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    trl_peer.write_records_file(a, 64, 0, "arith")
    trl_peer.write_records_file(b, 64, 0, "arith")
    assert a.read_bytes() == b.read_bytes()
    records = read_records(str(a))
    assert len(records) == 64 and {r.task for r in records} == {"math"}
    assert len({r.prompt for r in records}) > 50
    tok = build_char_tokenizer()
    unk = tok.convert_tokens_to_ids(UNK)
    for r in records:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert unk not in ids and len(ids) == len(r.prompt)


@pytest.mark.parametrize("text", ["so #### 12", "The answer is -3.", "#### 4\nthe answer is 5", "12", "answer: 7",
                                  "#### 2 \n#### 9"])
def test_trl_reward_extracts_like_the_math_grader(text):
    assert final_answer(text) == extract_final_answer(text)


def test_trl_reward_values():
    reward = exact_integer_reward(5.0, -5.0)
    out = reward(prompts=["p"] * 4, completions=["#### 6", "the answer is 6", "#### 6.5", "6"], answer=["6"] * 4)
    assert out == [5.0, 5.0, -5.0, -5.0]


def test_trl_throughput_skips_the_warmup_steps(monkeypatch):
    monkeypatch.setattr(trl_peer, "WARMUP", 2)
    rows = [{"end_s": e, "completion_tokens": t} for e, t in [(11.0, 100), (12.0, 100), (14.0, 300), (15.0, 200)]]
    got = trl_peer.trl_throughput(rows, train_start_s=10.0)
    assert got["effective_train_tokens_per_s"] == pytest.approx(500 / 3.0)  # steps 3-4: 500 tokens in 15 - 12 s
    assert got["per_step_tokens_per_s"]["min"] == pytest.approx(150.0)
    assert got["per_step_tokens_per_s"]["max"] == pytest.approx(200.0)
    assert got["tokens_trained"] == 700


def test_areal_config_sync_and_async():
    sync = trl_peer.areal_config("sync", "/m", "/r.jsonl", "/e.jsonl", 8, 4, 64, 30, None)
    asyn = trl_peer.areal_config("async", "/m", "/r.jsonl", "/e.jsonl", 8, 4, 64, 30, None)
    for cfg in (sync, asyn):
        assert cfg.trainer.batch_size == 32 and cfg.rollout.n_samples == 4
        assert cfg.rollout.sampling.max_new_tokens == 64 and cfg.model.name == "/m"
        assert cfg.rollout.torch_threads == 1 and cfg.trainer.torch_threads is None  # the default split
    from areal_core.run import trainer_torch_threads

    # sync: generation is idle while the trainer works, so it gets both cores; async: the one left
    assert [trainer_torch_threads(c, trl_peer.CORES) for c in (sync, asyn)] == [2, 1]
    assert (sync.trainer.eta, sync.rollout.weight_update) == (0, "drain")
    assert (asyn.trainer.eta, asyn.rollout.weight_update) == (4, "reprefill")
    with pytest.raises(ValueError, match="mode must be"):
        trl_peer.areal_config("fast", "/m", "/r.jsonl", "/e.jsonl", 8, 4, 64, 30, None)
