"""TRL's side of ``bench/trl_peer.py``: one ``GRPOTrainer`` run, run by the TRL venv's Python.

    bench/.venvs/trl/bin/python bench/trl_worker.py SPEC.json OUT.json

SPEC.json (written by ``bench.trl_peer``): ``model`` (an HF folder), ``records`` (the
areal-flow records file, .jsonl: its ``prompt`` and ``answer`` fields), ``prompts_per_step``
(P), ``answers_per_prompt`` (G), ``max_new_tokens``, ``steps``, ``threads``, ``lr``,
``reward_correct``, ``reward_wrong``, ``seed`` and ``work_dir``.

Fully on-policy GRPO: per_device_train_batch_size = P*G, num_generations = G,
gradient_accumulation_steps 1 (one generation per step, each answer trained once),
beta 0 (no reference model), num_iterations 1, HF ``generate`` (use_vllm False), fp32
on the CPU with ``threads`` torch threads.

OUT.json: per optimizer step, the wall clock at its end (``perf_counter``, so differences
are step times) and the completion tokens it generated and trained on (TRL's logged
``completions/mean_length`` x P*G; completion lengths count the EOS token, as areal-flow's
do), plus the versions and the time to build the trainer. This file imports nothing from
areal-flow: it runs in another venv.
"""

from __future__ import annotations

import json
import re
import sys
import time

_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]+)", re.IGNORECASE)
_INT = re.compile(r"^[-+]?\d+$")


def final_answer(text: str) -> str | None:
    """The stated final answer, by areal-flow's math grader's rules for this tokenizer's characters
    (``#### N``, else ``the answer is N``; it has no backslash or braces, so no ``\\boxed``)."""
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().strip("$").rstrip(".").strip() or None
    return None


def exact_integer_reward(correct: float, wrong: float):
    """A TRL reward function: ``correct`` when the final answer is the reference integer, else ``wrong``."""

    def reward(prompts, completions, answer, **_):
        out = []
        for text, ref in zip(completions, answer):
            got = final_answer(text)
            ok = got is not None and _INT.match(got) is not None and int(got) == int(ref)
            out.append(correct if ok else wrong)
        return out

    reward.__name__ = "exact_integer"
    return reward


def read_prompts(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt" not in rec or "answer" not in rec:
                raise ValueError(f"{path}, line {lineno}: a record needs 'prompt' and 'answer'")
            rows.append({"prompt": rec["prompt"], "answer": rec["answer"]})
    if not rows:
        raise ValueError(f"{path}: no records")
    return rows


def run(spec: dict) -> dict:
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.disable_progress_bar()
    P, G = int(spec["prompts_per_step"]), int(spec["answers_per_prompt"])
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, local_files_only=True)
    data = datasets.Dataset.from_list(read_prompts(spec["records"]))
    args = GRPOConfig(
        output_dir=spec["work_dir"], per_device_train_batch_size=P * G, num_generations=G,
        gradient_accumulation_steps=1, num_iterations=1, beta=0.0, use_vllm=False,
        max_completion_length=int(spec["max_new_tokens"]), temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=float(spec["lr"]), max_steps=int(spec["steps"]), seed=int(spec["seed"]),
        bf16=False, fp16=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    steps: dict[int, dict] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.setdefault(state.global_step, {})["end_s"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                row = steps.setdefault(state.global_step, {})
                row["completion_tokens"] = round(logs["completions/mean_length"] * P * G)
                row["reward"] = logs.get("reward")

    trainer = GRPOTrainer(model=model, reward_funcs=exact_integer_reward(spec["reward_correct"], spec["reward_wrong"]),
                          args=args, train_dataset=data, processing_class=tokenizer, callbacks=[StepClock()])
    t_ready = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    rows = [{"step": k, **v} for k, v in sorted(steps.items())]
    missing = [r["step"] for r in rows if "end_s" not in r or "completion_tokens" not in r]
    if missing or len(rows) != int(spec["steps"]):
        raise RuntimeError(f"TRL logged {len(rows)} steps of {spec['steps']}; steps without time or lengths: {missing}")
    return {"versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "torch_threads": torch.get_num_threads(), "setup_s": t_ready - t0, "train_start_s": t_ready,
            "train_end_s": t_end, "steps": rows}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
