"""TRL's side of ``bench/trl_peer.py``: one ``GRPOTrainer`` run, run by the TRL venv's Python.

    bench/.venvs/trl/bin/python bench/trl_worker.py SPEC.json OUT.json

SPEC.json (written by ``bench.trl_peer_inputs.trl_spec``): ``model`` (an HF folder), ``records``
(the areal-flow records file, .jsonl: its ``prompt`` and ``answer`` fields), ``chat`` (true: each
prompt is one user message, rendered by the tokenizer's chat template as areal-flow's
``encode_prompt`` renders it), ``prompts_per_step`` (P), ``answers_per_prompt`` (G),
``micro_batches`` (default 1), ``max_new_tokens``, ``temperature``, ``steps``, ``threads``,
``dtype`` (float32, or bfloat16: bf16 autocast over float32 weights), ``lr``, ``weight_decay``,
``adam_beta2``, ``adam_epsilon``, ``reward_correct``, ``reward_wrong``, ``seed``, ``work_dir``, and
optionally ``trl_args``: GRPOConfig fields that override this worker's (A/B runs of TRL's own
settings: ``bench/trl_peer_ab.py``), and ``save_every`` with ``save_dir``: the model and tokenizer
saved as an HF folder ``save_dir/step-N`` after every ``save_every``-th step, for an evaluation
afterwards (``bench/learning_wallclock.py``).

Fully on-policy GRPO: num_generations G; per_device_train_batch_size P*G / micro_batches and
gradient_accumulation_steps micro_batches, so steps_per_generation too: one generation of P*G
answers per optimizer step, each trained once, in micro_batches parts (TRL's loss normalizes over
the whole generation batch, so the parts bound memory and leave the update as it is); beta 0 (no
reference model), num_iterations 1, HF ``generate`` (use_vllm False), on the CPU with ``threads``
torch threads, constant learning rate. TRL's defaults that cost time and are no part of GRPO are
turned off (``SPEED``; ``python -m bench trl_peer_ab`` measures what each costs).

OUT.json: per optimizer step, the wall clock at its end (``perf_counter``, so differences are
step times), the process's CPU time then (``process_time``: other work on the machine disturbs
it far less than the wall clock), the completion tokens it generated and trained on (counted in
the reward function from the completion ids TRL hands it; they count the EOS token, as
areal-flow's do) and the torch threads; TRL's own ``train_runtime`` and
``train_samples_per_second`` and the wall time of the whole ``train()`` call (second clocks);
the GRPOConfig arguments, the tokenizer class, the versions and the time to build the trainer;
with ``save_every``, ``snapshots``: each saved folder, its step and the seconds the save took (after
that step's clock reading, so a step's time includes the saves before it and none of its own).
This file imports nothing from areal-flow: it runs in another venv.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]+)", re.IGNORECASE)
_BOLD = re.compile(r"\\textbf\s*\{([^{}]*)\}")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.0+)?$")

# TRL defaults that cost time on a CPU and are no part of the algorithm (A/B: bench/trl_peer_ab.py):
# gradient checkpointing (TRL's default True; transformers 5 names it activation_checkpointing)
# recomputes every layer's forward during backward: +23 % CPU per token measured on the tiny model
SPEED = {"activation_checkpointing": False}


# --- the reward: areal-flow's math grader's extraction, exact integer comparison ----------------


def _last_boxed(text: str) -> str | None:
    for start in reversed([m.end() for m in _BOXED.finditer(text)]):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


def _clean_tail(ans: str) -> str:
    ans = ans.strip().strip("$").strip()
    ans = re.sub(r"[.。]\s*$", "", ans).strip()
    return ans.strip("$").strip()


def final_answer(text: str) -> str | None:
    """The stated final answer by areal-flow's math grader's rules (``reward/math.py``): the last
    ``\\boxed{...}``, else ``#### N``, else ``the answer is N``; bold and a final full stop dropped."""
    found = _last_boxed(text)
    if not found:
        hashes = _HASHES.findall(text)
        said = _ANSWER_IS.findall(text)
        found = (
            _clean_tail(hashes[-1]).replace("$", "") if hashes else _clean_tail(said[-1]) if said else None
        ) or None
    if found is None:
        return None
    return re.sub(r"(?<![.\\])\.$", "", _BOLD.sub(r"\1", found).strip()).strip() or None


def is_integer_answer(got: str | None, ref: str) -> bool:
    """``got`` states the integer ``ref`` (``85``, ``85.0``, ``1,000``, ``$85$``)."""
    if got is None:
        return False
    got = re.sub(r"[\s$]", "", got).replace(",", "")
    return _NUMBER.match(got) is not None and int(float(got)) == int(ref)


def completion_text(completion) -> str:
    """A completion's text: a plain string, or (conversational prompts) ``[{"role": "assistant", ...}]``."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")


def exact_integer_reward(correct: float, wrong: float, tokens: list[int] | None = None):
    """A TRL reward function: ``correct`` when the final answer is the reference integer, else ``wrong``.
    With ``tokens``, each call (one per step) appends the number of completion tokens it scores."""

    def reward(prompts, completions, answer, completion_ids=None, **_):
        if tokens is not None:
            if completion_ids is None:
                raise RuntimeError("TRL did not pass completion_ids to the reward function; cannot count tokens")
            tokens.append(sum(len(ids) for ids in completion_ids))
        return [
            correct if is_integer_answer(final_answer(completion_text(c)), ref) else wrong
            for c, ref in zip(completions, answer)
        ]

    reward.__name__ = "exact_integer"
    return reward


# --- inputs ---------------------------------------------------------------------------------------


def read_prompts(path: str, chat: bool) -> list[dict]:
    """The records' prompts and answers; ``chat``: each prompt as one user message."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt" not in rec or "answer" not in rec:
                raise ValueError(f"{path}, line {lineno}: a record needs 'prompt' and 'answer'")
            prompt = [{"role": "user", "content": rec["prompt"]}] if chat else rec["prompt"]
            rows.append({"prompt": prompt, "answer": rec["answer"]})
    if not rows:
        raise ValueError(f"{path}: no records")
    return rows


def load_tokenizer(folder: str):
    """The tokenizer as saved, as areal-flow loads it (``areal_core/models/tokenizer.py``): a
    one-character WordLevel ``tokenizer.json`` as the fast tokenizer it is (next to a Qwen2
    config.json, ``AutoTokenizer`` builds a Qwen2Tokenizer whose byte-level pre-tokenizer drops
    every space and newline), anything else through ``AutoTokenizer``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if json.load(f).get("model", {}).get("type") == "WordLevel":
                return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def grpo_args(spec: dict) -> dict:
    """The GRPOConfig keyword arguments of ``spec``: the algorithm, then SPEED, then ``trl_args``."""
    P, G, micro = int(spec["prompts_per_step"]), int(spec["answers_per_prompt"]), int(spec.get("micro_batches", 1))
    if (P * G) % micro:
        raise ValueError(f"micro_batches {micro} does not divide the {P * G} answers of a step")
    if spec["dtype"] not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {spec['dtype']!r}")
    args = dict(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=P * G // micro,
        num_generations=G,
        gradient_accumulation_steps=micro,
        num_iterations=1,
        beta=0.0,
        use_vllm=False,
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        top_k=0,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        weight_decay=float(spec["weight_decay"]),
        adam_beta2=float(spec["adam_beta2"]),
        adam_epsilon=float(spec["adam_epsilon"]),
        max_grad_norm=1.0,
        max_steps=int(spec["steps"]),
        seed=int(spec["seed"]),
        bf16=spec["dtype"] == "bfloat16",
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return {**args, **SPEED, **spec.get("trl_args", {})}


# --- the run ------------------------------------------------------------------------------------------


def run(spec: dict) -> dict:
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, local_files_only=True)
    data = datasets.Dataset.from_list(read_prompts(spec["records"], bool(spec["chat"])))
    kwargs = grpo_args(spec)
    args = GRPOConfig(**kwargs)
    ends: list[float] = []
    cpu: list[float] = []
    threads: list[int] = []
    tokens: list[int] = []
    rewards: list[float] = []
    snapshots: list[dict] = []
    save_every = int(spec.get("save_every") or 0)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
            threads.append(torch.get_num_threads())
            if save_every and state.global_step % save_every == 0:
                snapshots.append(save_snapshot(model, tokenizer, spec["save_dir"], state.global_step))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    reward = exact_integer_reward(spec["reward_correct"], spec["reward_wrong"], tokens)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    t_ready, cpu_ready = time.perf_counter(), time.process_time()
    out = trainer.train()
    t_end = time.perf_counter()
    if len(ends) != int(spec["steps"]) or len(tokens) != len(ends):
        raise RuntimeError(f"TRL ran {len(ends)} steps of {spec['steps']} and scored {len(tokens)} batches")
    steps = [
        {"step": i + 1, "end_s": e, "cpu_s": c, "completion_tokens": n, "torch_threads": th}
        for i, (e, c, n, th) in enumerate(zip(ends, cpu, tokens, threads))
    ]
    for row, r in zip(steps, rewards if len(rewards) == len(steps) else []):
        row["reward"] = r
    return {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "setup_s": t_ready - t0,
        "train_start_s": t_ready,
        "train_end_s": t_end,
        "train_call_s": t_end - t_ready,
        "train_start_cpu_s": cpu_ready,
        "trl_metrics": {
            k: out.metrics[k]
            for k in ("train_runtime", "train_samples_per_second", "train_steps_per_second")
            if k in out.metrics
        },
        "grpo_args": {k: v for k, v in kwargs.items() if k != "output_dir"},
        "activation_checkpointing_on": bool(getattr(model, "is_activation_checkpointing", False)),
        "tokenizer": type(tokenizer).__name__,
        "steps": steps,
        "snapshots": snapshots,
    }


def save_snapshot(model, tokenizer, save_dir: str, step: int) -> dict:
    """The model and its tokenizer as an HF folder ``save_dir/step-STEP``; the seconds it took."""
    t0 = time.perf_counter()
    folder = os.path.join(save_dir, f"step-{step}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"step": step, "dir": folder, "save_s": time.perf_counter() - t0}


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
