"""Part (b): the embedded engine against HF ``generate`` on the same model, device and dtype.

Each batch size: the task's prompts cut to one length, ``new_tokens`` sampled per prompt at
temperature 1 (``ignore_eos``; HF: ``min_new_tokens``), the two alternating ``reps`` times after a
warm-up. Output tokens/s = batch x new tokens / wall time (the GPU synchronised at both ends).

Logprobs: the engine's behaviour logprob of every token it sampled against HF's own forward over the
same prompt + answer, in the same dtype. Tolerances (per token, |engine - HF|):
* the compute dtype (bfloat16 on a GPU): mean <= 0.1 and 99th percentile <= 0.6 (each side rounds
  its own intermediate results, fused vs separate projections: tests/unit/test_engine_forward.py; SmolLM2
  in bfloat16 on a CPU, 6 prompts x 16 tokens: mean 0.037, 99th percentile 0.17, max 0.20; a wrong
  position or mask moves the mean by tenths to whole nats);
* float32, on a few short answers: max <= 1e-3.
"""

from __future__ import annotations

import torch

from infra.gpu_smoke.common import Clock, Setup, equal_length_prompts, median

BF16_MEAN_TOL, BF16_P99_TOL, FP32_MAX_TOL = 0.1, 0.6, 1e-3


def run_engine(model, batch: list[list[int]], new: int) -> tuple[float, list]:
    """(seconds, responses) of one batch through a fresh engine driven in this thread."""
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    eng = RolloutEngine(
        model,
        max_running=len(batch),
        start=False,
        kv_slots=len(batch),
        kv_capacity=len(batch[0]) + new + 1,
        seed=len(batch),
    )
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": new, "ignore_eos": True}
    try:
        with Clock(eng.device) as c:
            futs = eng.submit_many([(p, sp, None) for p in batch])
            while eng.step():
                pass
        out = [f.result() for f in futs]
    finally:
        eng.shutdown()
    n = sum(len(r.output_ids) for r in out)
    if n != len(batch) * new:
        raise RuntimeError(f"the engine generated {n} tokens, {len(batch) * new} were asked for")
    return c.s, out


def run_hf(model, batch: list[list[int]], new: int, pad: int) -> float:
    ids = torch.tensor(batch, device=model.device)
    with torch.no_grad(), Clock(model.device) as c:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad,
        )
    if out.shape != (len(batch), len(batch[0]) + new):
        raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}")
    return c.s


@torch.no_grad()
def hf_logprobs(model, prompts: list[list[int]], answers: list[list[int]], chunk: int = 16) -> list[torch.Tensor]:
    """HF's log-softmax (temperature 1) of each answer token given the prompt and the answer so far."""
    out = []
    for a in range(0, len(prompts), chunk):
        ps, ans = prompts[a : a + chunk], answers[a : a + chunk]
        ids = torch.tensor([p + x for p, x in zip(ps, ans)], device=model.device)  # equal lengths: no padding
        logits = model(input_ids=ids).logits
        L = len(ps[0])
        for j, x in enumerate(ans):
            lp = torch.log_softmax(logits[j, L - 1 : L - 1 + len(x)].float(), -1)
            out.append(lp.gather(-1, torch.tensor(x, device=model.device)[:, None])[:, 0].cpu())
    return out


def compare(engine_out: list, prompts: list[list[int]], model) -> dict:
    """Per-token |engine behaviour logprob - HF logprob| over every sampled token."""
    answers = [r.output_ids for r in engine_out]
    got = torch.cat([torch.tensor([lp for lp, _, _ in r.meta_info.output_token_logprobs]) for r in engine_out])
    want = torch.cat(hf_logprobs(model, prompts, answers))
    d = (got - want).abs()
    return {
        "tokens": int(d.numel()),
        "mean_abs": float(d.mean()),
        "p99_abs": float(d.quantile(0.99)),
        "max_abs": float(d.max()),
        "mean_logprob": float(want.mean()),
    }


def engine_part(s: Setup) -> dict:
    a = s.args
    model = s.device_model()
    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    warm = equal_length_prompts(s.prompts, min(8, max(a.batches)))
    run_engine(model, warm, 4)  # first-call costs (kernels, allocator) off the clock
    run_hf(model, warm, 4, pad)
    rows, check = [], None
    for bs in a.batches:
        batch = equal_length_prompts(s.prompts, bs, a.prompt_len)
        e_runs, h_runs = [], []
        for r in range(a.reps):  # alternate, so drift in clocks or load hits both
            order = ("engine", "hf") if r % 2 == 0 else ("hf", "engine")
            for who in order:
                if who == "engine":
                    t, out = run_engine(model, batch, a.new_tokens)
                    e_runs.append(bs * a.new_tokens / t)
                else:
                    h_runs.append(bs * a.new_tokens / run_hf(model, batch, a.new_tokens, pad))
        e, h = median(e_runs), median(h_runs)
        rows.append(
            {
                "batch": bs,
                "prompt_tokens": len(batch[0]),
                "new_tokens": a.new_tokens,
                "engine_tokens_per_s": e,
                "hf_generate_tokens_per_s": h,
                "engine_over_hf": e / h,
                "engine_runs": e_runs,
                "hf_runs": h_runs,
            }
        )
        if bs == max(a.batches):
            check = compare(out, batch, model)
    check.update(
        dtype=str(s.dtype).removeprefix("torch."),
        ok=check["mean_abs"] <= BF16_MEAN_TOL and check["p99_abs"] <= BF16_P99_TOL,
        tolerance=f"mean <= {BF16_MEAN_TOL}, p99 <= {BF16_P99_TOL}",
    )
    del model
    model32 = s.device_model(torch.float32)
    few = equal_length_prompts(s.prompts, 8, a.prompt_len)
    _, out32 = run_engine(model32, few, min(32, a.new_tokens))
    check32 = compare(out32, few, model32)
    check32.update(ok=check32["max_abs"] <= FP32_MAX_TOL, tolerance=f"max <= {FP32_MAX_TOL}")
    return {
        "device": str(s.device),
        "dtype": str(s.dtype).removeprefix("torch."),
        "rows": rows,
        "logprobs": check,
        "logprobs_float32": check32,
        "ok": check["ok"] and check32["ok"],
    }
