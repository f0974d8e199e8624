"""What the trainer and the rollout engine compute, as digests, on 1 to 4 threads: the tests run
this in subprocesses under each kernel family torch offers here (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``) and check that the thread count changes no bit.

``python -m tests.numerics_probe --threads 1,2,3,4 --dtypes float32,bfloat16`` prints one JSON object:
the process's :func:`areal_core.numerics.cpu_kind` and, per case and thread count, a digest.

The cases are sized so that every reduction torch parallelises is parallel here: weight matrices
and a micro-batch of over 32,768 tokens (a full sum over them splits between threads), long
weight-gradient sums (a matrix product's shared dimension of thousands of tokens), a clipped
gradient norm, two minibatches (recomputed proximal logprobs), AdamW; and the engine's prefill,
decode and sampler over a batch of requests with keyed sampling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct

import torch

import areal_core  # noqa: F401  (sets MKL's mode before torch computes anything)
from areal_core.numerics import cpu_kind, require_repeatable, thread_invariant
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory
from tests.unit.test_engine import tiny_model

VOCAB = 384


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _model(arch: str, dtype: torch.dtype, **size) -> torch.nn.Module:
    """The engine tests' tiny decoder (``qwen2``: untied, with biases; ``llama``: tied embeddings),
    96 wide by default: its 96 x 384 MLP matrices exceed torch's grain for one reduction."""
    shape = dict(hidden_size=96, intermediate_size=384, num_attention_heads=6, vocab_size=VOCAB)
    return tiny_model(arch, max_position_embeddings=1024, **{**shape, **size}).to(dtype)


def _batch(seed: int, n_groups: int, n: int, prompt_len: int, answer: tuple[int, int]) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(4, VOCAB) for _ in range(prompt_len)]
        for i in range(n):
            k = rng.randrange(*answer)
            out.append(
                Trajectory(
                    traj_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    seq_no=g * n + i,
                    admit_version=0,
                    prompt_ids=prompt,
                    output_ids=[rng.randrange(4, VOCAB) for _ in range(k)],
                    output_logprobs=[-rng.uniform(3.0, 9.0) for _ in range(k)],
                    output_versions=[0] * k,
                    finish_reason="stop",
                    reward=rng.choice([-5.0, 5.0]),
                )
            )
    return out


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().float().contiguous().view(torch.int32).numpy().tobytes())
        elif isinstance(p, float):
            h.update(struct.pack("<d", p))
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


TRAINER_CASES = {
    # two minibatches (pi_prox recomputed), small micro-batches, a clip that binds
    "trainer-llama-tied": dict(
        arch="llama",
        batch=dict(n_groups=8, n=8, prompt_len=24, answer=(8, 48)),
        cfg=dict(ppo_minibatches=2, max_tokens_per_microbatch=2048, optim={"grad_clip": 0.05}),
    ),
    # one micro-batch of over 32,768 tokens: the loss's sums and the weight gradients' long sums; one
    # step (its AdamW update included) holds every such sum, and a second would only repeat them over
    # other numbers (what a second step adds, moments already set, the case above has)
    "trainer-qwen2-long": dict(
        arch="qwen2",
        size=SMALL,  # (a small model: the case is about the length)
        batch=dict(n_groups=4, n=16, prompt_len=16, answer=(500, 560)),
        cfg=dict(ppo_minibatches=1, max_tokens_per_microbatch=40_000, optim={"grad_clip": 1.0}),
        steps=1,
    ),
}


def trainer_digest(case: dict, dtype: torch.dtype) -> tuple[str, dict]:
    model = _model(case["arch"], dtype, **case.get("size", {}))
    batch = _batch(1, **case["batch"])
    cfg = TrainerConfig(batch_size=len(batch), microbatching="dynamic", **case["cfg"])
    trainer = Trainer(model, cfg, temperature=1.0, total_steps=10)
    metrics = []
    for step in range(case.get("steps", 2)):
        r = trainer.step(batch if step == 0 else _batch(2, **case["batch"]), version=step)
        metrics.append({k: v for k, v in r.metrics.items() if isinstance(v, float) and not k.endswith("time_s")})
    state = trainer.optimizer.state_dict()["state"]
    moments = [t for s in state.values() for k, t in sorted(s.items()) if isinstance(t, torch.Tensor)]
    flat = [float(v) for m in metrics for _, v in sorted(m.items())]
    return _digest(*trainer.masters, *moments, *flat), metrics[-1]


def engine_digest(dtype: torch.dtype, invariant: bool) -> str:
    from areal_core.rollout.backends.embedded.engine import RolloutEngine

    model = _model("qwen2", dtype).eval()
    rng = random.Random(3)
    jobs = [
        (
            [rng.randrange(4, VOCAB) for _ in range(rng.randrange(8, 40))],
            {"temperature": 1.0, "max_new_tokens": rng.randrange(8, 40), "ignore_eos": True, "sampling_seed": 7 + i},
            f"r{i}",
        )
        for i in range(24)
    ]
    eng = RolloutEngine(model, max_running=len(jobs), start=False, batch_invariant=invariant)
    futs = eng.submit_many(jobs)
    while eng.step():
        pass
    outs = [f.result() for f in futs]
    return _digest(*[(o.output_ids, [float(lp) for lp, _, _ in o.meta_info.output_token_logprobs]) for o in outs])


def run(threads: list[int], dtypes: list[str], cases: list[str]) -> dict:
    mode = require_repeatable()
    out: dict = {"kind": cpu_kind(), "mkl_mode": mode, "digests": {}, "thread_invariant": {}}
    for dname in dtypes:
        dtype = getattr(torch, dname)
        out["thread_invariant"][dname] = thread_invariant(dtype)
        for case in cases:
            key = f"{case}/{dname}"
            out["digests"][key] = {}
            for n in threads:
                torch.set_num_threads(n)
                if case in TRAINER_CASES:
                    digest, _ = trainer_digest(TRAINER_CASES[case], dtype)
                else:
                    digest = engine_digest(dtype, invariant=case.endswith("invariant"))
                out["digests"][key][str(n)] = digest
    return out


CASES = (*TRAINER_CASES, "engine", "engine-invariant")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", default="1,2,3,4")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args(argv)
    print(json.dumps(run([int(t) for t in a.threads.split(",")], a.dtypes.split(","), a.cases.split(","))))


if __name__ == "__main__":
    main()
