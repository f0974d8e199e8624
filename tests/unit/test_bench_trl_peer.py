"""The TRL peer benchmarks' own pieces (not their timings): problems, records, reward rules, the prompts'
token ids on both sides, throughput and clocks, and the one workload both sides' settings come from."""

from __future__ import annotations

import json
import random
import re

import pytest

from areal_core.data.prompting import encode_prompt
from areal_core.data.records import Record, read_records
from areal_core.models.tokenizer import UNK, build_char_tokenizer
from areal_core.models.tokenizer import load_tokenizer as areal_load_tokenizer
from areal_core.reward.math import extract_final_answer
from bench import trl_peer_inputs as inputs
from bench import trl_peer_report, trl_peer_systems
from bench.trl_worker import exact_integer_reward, final_answer, grpo_args, read_prompts
from bench.trl_worker import load_tokenizer as worker_load_tokenizer
from tests.bench_workloads import workload

PROMPT = re.compile(r"^Compute (\d(?:[+*-]\d){2,3}) =$")


def test_problems_are_evaluated_with_operator_precedence():
    rng = random.Random(7)
    for _ in range(300):
        prompt, value = inputs.arithmetic_problem(rng)
        m = PROMPT.match(prompt)
        assert m, prompt
        assert value == eval(m.group(1), {"__builtins__": {}})  # Python's own precedence: the reference


def test_records_file_is_deterministic_math_and_in_the_tokenizer(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    inputs.write_records_file(a, 64, 0, "arith")
    inputs.write_records_file(b, 64, 0, "arith")
    assert a.read_bytes() == b.read_bytes()
    records = read_records(str(a))
    assert len(records) == 64 and {r.task for r in records} == {"math"}
    assert len({r.prompt for r in records}) > 50
    tok = build_char_tokenizer()
    unk = tok.convert_tokens_to_ids(UNK)
    for r in records:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert unk not in ids and len(ids) == len(r.prompt)


@pytest.mark.parametrize(
    "text",
    [
        "so #### 12",
        "The answer is -3.",
        "#### 4\nthe answer is 5",
        "12",
        "answer: 7",
        "#### 2 \n#### 9",
        "44 + 24 = 68. The answer is 68.",
        r"so \boxed{85}.",
        r"The answer is \textbf{42}.",
        "The answer is $1,000$.",
        "#### $7$",
        r"\boxed{\frac{1}{2}} and the answer is 3",
    ],
)
def test_trl_reward_extracts_like_the_math_grader(text):
    assert final_answer(text) == extract_final_answer(text)


def test_trl_reward_values_plain_and_conversational():
    reward = exact_integer_reward(5.0, -5.0)
    texts = ["#### 6", "the answer is 6", "#### 6.5", "6", "The answer is 6.", r"\boxed{6}", "The answer is 1,006."]
    want = [5.0, 5.0, -5.0, -5.0, 5.0, 5.0, -5.0]
    assert reward(prompts=["p"] * 7, completions=texts, answer=["6"] * 7) == want
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    assert reward(prompts=["p"] * 7, completions=chat, answer=["6"] * 7) == want
    assert reward(prompts=["p"], completions=["The answer is 1,006."], answer=["1006"]) == [5.0]


def test_trl_reward_counts_the_tokens_of_each_batch():
    tokens: list[int] = []
    reward = exact_integer_reward(5.0, -5.0, tokens)
    reward(prompts=["p"] * 2, completions=["a", "b"], answer=["1", "2"], completion_ids=[[1, 2, 3], [4]])
    reward(prompts=["p"], completions=["a"], answer=["1"], completion_ids=[[1, 2]])
    assert tokens == [4, 2]
    with pytest.raises(RuntimeError, match="completion_ids"):
        reward(prompts=["p"], completions=["a"], answer=["1"])


def _out(ends, tokens, cpu=None, start=10.0):
    steps = [
        {"end_s": e, "completion_tokens": t, **({"cpu_s": c} if cpu else {})}
        for e, t, c in zip(ends, tokens, cpu or [None] * len(ends))
    ]
    return {
        "steps": steps,
        "train_start_s": start,
        "train_start_cpu_s": 1.0,
        "train_call_s": 6.0,
        "trl_metrics": {"train_runtime": 5.5, "train_samples_per_second": 20.0},
    }


def test_trl_throughput_skips_the_warmup_steps_and_puts_the_clocks_side_by_side(monkeypatch):
    monkeypatch.setattr(trl_peer_systems, "WARMUP", 2)
    got = trl_peer_systems.trl_throughput(_out([11.0, 12.0, 14.0, 15.0], [100, 100, 300, 200], [2.0, 3.0, 5.0, 6.0]))
    assert got["effective_train_tokens_per_s"] == pytest.approx(500 / 3.0)  # steps 3-4: 500 tokens in 15 - 12 s
    assert got["per_step_tokens_per_s"]["min"] == pytest.approx(150.0)
    assert got["per_step_tokens_per_s"]["max"] == pytest.approx(200.0)
    assert got["tokens_trained"] == 700
    assert got["cpu_s_per_1k_tokens"] == pytest.approx(1000 * 3.0 / 500)
    clocks = got["clocks"]
    assert clocks["step_clock_tokens_per_s"] == pytest.approx(700 / 5.0)
    assert clocks["train_call_tokens_per_s"] == pytest.approx(700 / 6.0)
    assert clocks["trl_train_runtime_tokens_per_s"] == pytest.approx(700 / 5.5)
    with pytest.raises(ValueError, match="warm-up"):
        trl_peer_systems.trl_throughput(_out([11.0, 12.0], [1, 1]))


_workload = workload


def test_areal_config_sync_and_async():
    w = _workload()
    sync, asyn = inputs.areal_config("sync", w, None), inputs.areal_config("async", w, None)
    for cfg in (sync, asyn):
        assert cfg.trainer.batch_size == 32 and cfg.rollout.n_samples == 4
        assert cfg.rollout.sampling.max_new_tokens == 64 and cfg.model.name == "/m"
        assert cfg.rollout.torch_threads == 1 and cfg.trainer.torch_threads is None  # the default split
    from areal_core.run.setup import trainer_torch_threads

    # sync: generation is idle while the trainer works, so it gets both cores; async: the one left
    assert [trainer_torch_threads(c, inputs.CORES) for c in (sync, asyn)] == [2, 1]
    assert (sync.trainer.eta, sync.rollout.weight_update) == (0, "drain")
    assert (asyn.trainer.eta, asyn.rollout.weight_update) == (4, "reprefill")
    # both at their fastest: neither pays for runs that repeat bit for bit (the synchronous default
    # would put its server on the batch-invariant engine; the asynchronous one lends cores)
    for cfg in (sync, asyn):
        assert (cfg.rollout.deterministic, cfg.rollout.batch_invariant) == (False, False)
    assert asyn.trainer.lend_idle_cores is True
    with pytest.raises(ValueError, match="mode must be"):
        inputs.areal_config("fast", w, None)


def test_a_synchronous_server_may_take_every_core_while_its_trainer_waits():
    import dataclasses

    from areal_core.run.setup import trainer_torch_threads

    w = dataclasses.replace(_workload(), sync_server_threads=inputs.CORES)
    sync, asyn = inputs.areal_config("sync", w, None), inputs.areal_config("async", w, None)
    assert (sync.rollout.torch_threads, asyn.rollout.torch_threads) == (2, 1)
    # the trainers' shares stay: sync trains on every core (its server idle), async on the core left
    assert [trainer_torch_threads(c, inputs.CORES) for c in (sync, asyn)] == [2, 1]


def test_step_parts_are_the_means_after_warm_up():
    import pandas as pd

    nan = float("nan")
    m = pd.DataFrame(
        {
            "train_time_s": [50.0, 50.0, 10.0, 12.0],
            "cost_trainer_waiting_rollout_s": [9.0, 9.0, 4.0, 6.0],
            "cost_rollout_generating_s": [40.0, 40.0, 5.0, 7.0],
            "trainer_own_threads_s": [1.0, 1.0, 6.0, 4.0],
            "trainer_lent_threads_s": [2.0, 2.0, 3.0, 5.0],
        }
    )
    assert inputs.WARMUP == 2
    assert trl_peer_systems.step_parts(m) == {
        "mean_train_s": 11.0,
        "mean_rollout_wait_s": 5.0,
        "mean_generating_s": 6.0,
        "mean_own_threads_s": 5.0,
        "mean_lent_threads_s": 4.0,
    }
    # without core lending (a synchronous run) the row holds NaN: no figure
    m["trainer_own_threads_s"] = m["trainer_lent_threads_s"] = nan
    parts = trl_peer_systems.step_parts(m)
    assert parts["mean_own_threads_s"] is None and parts["mean_lent_threads_s"] is None


@pytest.mark.parametrize(
    "w",
    [
        _workload(),
        _workload(
            name="smollm2",
            prompts_per_step=8,
            answers_per_prompt=8,
            max_new_tokens=40,
            temperature=0.6,
            lr=1e-5,
            dtype="bfloat16",
            chat=True,
            steps=10,
            max_tokens_per_microbatch=2048,
            trl_micro_batches=4,
        ),
    ],
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_both_sides_get_the_same_settings(w, mode, tmp_path):
    cfg = inputs.areal_config(mode, w, None)
    args = grpo_args(inputs.trl_spec(w, tmp_path))
    P, G = w.prompts_per_step, w.answers_per_prompt
    assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == cfg.trainer.batch_size == P * G
    assert args["num_generations"] == cfg.rollout.n_samples == G
    assert args["max_completion_length"] == cfg.rollout.sampling.max_new_tokens == w.max_new_tokens
    assert args["temperature"] == cfg.rollout.sampling.temperature == w.temperature
    assert (args["top_p"], args["top_k"]) == (cfg.rollout.sampling.top_p, cfg.rollout.sampling.top_k) == (1.0, 0)
    assert args["learning_rate"] == cfg.trainer.optim.lr == w.lr
    assert args["max_steps"] == cfg.trainer.max_steps == w.steps
    assert args["weight_decay"] == cfg.trainer.optim.weight_decay
    assert args["adam_beta2"] == cfg.trainer.optim.beta2 and args["adam_epsilon"] == cfg.trainer.optim.eps
    assert args["max_grad_norm"] == cfg.trainer.optim.grad_clip
    assert (args["lr_scheduler_type"], cfg.trainer.optim.lr_schedule) == ("constant", "constant")
    assert args["bf16"] == (cfg.model.dtype == "bfloat16") == (w.dtype == "bfloat16")
    assert (args["beta"], args["num_iterations"], args["use_vllm"]) == (0.0, 1, False)
    assert args["activation_checkpointing"] is False  # transformers 5's name of gradient_checkpointing
    assert cfg.trainer.reward_correct == inputs.REWARD_CORRECT and cfg.trainer.reward_wrong == inputs.REWARD_WRONG
    if w.max_tokens_per_microbatch is not None:
        assert cfg.trainer.max_tokens_per_microbatch == w.max_tokens_per_microbatch


def test_trl_args_override_the_workers_settings(tmp_path):
    args = grpo_args(inputs.trl_spec(_workload(), tmp_path, trl_args={"activation_checkpointing": True}))
    assert args["activation_checkpointing"] is True
    with pytest.raises(ValueError, match="micro_batches"):
        grpo_args(inputs.trl_spec(_workload(trl_micro_batches=3), tmp_path))


def test_smollm2_workload_follows_the_quickstart_config(tmp_path, monkeypatch):
    from areal_core.eval import harness
    from areal_core.experiment import load_config

    monkeypatch.setattr(harness, "model_folder", lambda name: f"/folder/of/{name}")
    w, _about = inputs.smollm2_workload(tmp_path, steps=10)
    cfg = load_config(inputs.SMOLLM2_CONFIG)
    assert w.model == "/folder/of/smollm2-135m" and w.chat and w.steps == 10
    assert (w.prompts_per_step, w.answers_per_prompt) == (8, 8) == (cfg.trainer.batch_size // 8, cfg.rollout.n_samples)
    assert (w.max_new_tokens, w.temperature, w.lr) == (40, 0.6, 1e-5)
    assert w.dtype == inputs.compute_dtype()[0] and w.dtype in ("float32", "bfloat16")
    records = read_records(w.records)
    assert len(records) == inputs.N_PROMPTS and {r.task for r in records} == {"math"}
    assert all(r.prompt.endswith("Write the calculation, then 'The answer is' and the number.") for r in records)
    rows = read_prompts(w.records, chat=True)
    assert rows[0] == {"prompt": [{"role": "user", "content": records[0].prompt}], "answer": records[0].answer}


def _chat_ids_agree(folder: str, prompts: list[str]) -> None:
    """TRL's rendering of conversational prompts (the tokenizer the worker loads) = areal-flow's encode_prompt."""
    trl_tok, areal_tok = worker_load_tokenizer(folder), areal_load_tokenizer(folder)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    trl_ids = trl_tok.apply_chat_template(
        conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    areal_ids = [
        encode_prompt(areal_tok, Record(id=str(i), task="math", prompt=p, answer="0")) for i, p in enumerate(prompts)
    ]
    assert trl_ids == areal_ids


def test_chat_prompts_token_ids_agree_with_a_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # what misleads AutoTokenizer
    _chat_ids_agree(str(tmp_path), ["What is 47 plus 38?\nWrite it.", "Mia has 12 cards. How many?"])


def test_worker_loads_the_tiny_tokenizer_as_areal_flow_does(tmp_path):
    folder = tmp_path / "tiny"
    inputs.write_tiny_model(folder, 0)
    prompt = "Compute 3+4*2-5 ="
    want = build_char_tokenizer().encode(prompt, add_special_tokens=False)
    assert worker_load_tokenizer(str(folder))(prompt)["input_ids"] == want  # spaces kept (46)


def test_smollm2_chat_prompts_token_ids_agree():
    from areal_core.eval.harness import _cache_root

    folder = _cache_root() / "smollm2-135m-hf"
    if not (folder / "tokenizer_config.json").exists():
        pytest.skip(f"no SmolLM2 HF folder at {folder} (python -m bench trl_peer_smollm2 writes it)")
    from areal_core.data.config import SyntheticArithTask
    from areal_core.data.synthetic_arith import ArithTask

    records = ArithTask(SyntheticArithTask(kind="arith", n_train=6, n_eval=1)).train_records()
    _chat_ids_agree(str(folder), [r.prompt for r in records])


def test_report_statistics_and_ratios():
    runs = [
        {
            label: {"effective_train_tokens_per_s": v, "load_avg_1m": [1.0, 1.5]}
            for label, v in zip(trl_peer_systems.SYSTEMS, vals)
        }
        for vals in ([100, 150, 200], [110, 160, 240])
    ]
    reps = [{"runs": r, "ratios": trl_peer_report.repetition_ratios(r)} for r in runs]
    res = trl_peer_report.summarize(_workload(), reps)
    assert res["ratios"]["async_over_trl"]["values"] == [2.0, pytest.approx(240 / 110)]
    assert res["ratios"]["async_over_sync"]["values"] == [pytest.approx(200 / 150), 1.5]
    trl = res["effective_train_tokens_per_s"][trl_peer_systems.TRL]
    assert (trl["mean"], trl["min"], trl["max"], trl["n"]) == (105, 100, 110, 2)
    assert trl["sd"] == pytest.approx(7.0710678)
