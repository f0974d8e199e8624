"""Simulated vs published AReaL figures, one setting for every row.

Published figures (the only ones used; every row names its source). The paper is Fu et al.
2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning", arXiv:2505.24298; its v0.3 blog (github.com/inclusionAI/AReaL,
blog/AReaL_v0_3.md) prints the same runs' hours:
* end to end (paper Table 1; blog Table 2): 1000 PPO steps, R1-Distill-Qwen 1.5B on 16
  nodes (128 H800) in 41.0 h synchronous vs 14.8 h asynchronous (2.77x, the paper's "up
  to 2.77x"); 7B on 24 nodes (192 H800) in 57.7 h vs 25.4 h (2.27x);
* interruptible generation (paper Fig. 6; blog Fig. 5): +12% (1.5B) and +17% (7B)
  generation throughput on 4 nodes (32 H800);
* strong scaling (the paper's scalability experiment, read as two claims, not as numbers
  read off its figure): AReaL's throughput scales near-linearly up to 512 GPUs; the gain
  over synchronous RL is smaller at 16K than at 32K context.

The shared setting (`PAPER_SETTING`): H800, rollout:trainer 3:1 (AReaL's benchmark
allocation, benchmark/verl_312a8cb/build_cmd.py), eta 4, reprefill updates, 128
prompts x 16 answers (the paper's batch as we read it; 512 x 16, the
benchmark README's batch, would need a trainer above 100% of peak FLOP/s to reach the
published 7B step time), 1024-token prompts, answers lognormal with median 6000 and
sigma 0.9 clipped at 31,744 (32K context, the benchmark's), 30 steps of which the
first 10 are warm-up (the pipeline fills). Nothing is fitted per row: every row uses the same `Efficiency()` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_core.sim.engine import SimConfig, SimResult, simulate
from areal_core.sim.lengths import LengthDist

PAPER = "Fu et al. 2025 (arXiv:2505.24298)"
BLOG = f"{PAPER}, Table 1; hours from the AReaL v0.3 blog, Table 2"
ABLATION = f"{PAPER}, Fig. 6 (interruptible-generation ablation; v0.3 blog Fig. 5)"
SCALING = f"{PAPER}, strong-scaling experiment (claim, not a read-off number)"

PAPER_SETTING = SimConfig(
    gpu="H800",
    mode="async",
    eta=4,
    weight_update="reprefill",
    prompts_per_step=128,
    answers_per_prompt=16,
    prompt_tokens=1024,
    lengths=LengthDist(max_new_tokens=31744, median=6000, sigma=0.9),
    n_steps=30,
    warmup_steps=10,
    seed=0,
)


@dataclass(frozen=True)
class ValidationRow:
    name: str
    published: float
    simulated: float
    source: str
    note: str = ""

    @property
    def rel_error(self) -> float:
        return (self.simulated - self.published) / self.published


def _run(settings: SimConfig, model: str, n_gpus: int, **changes) -> SimResult:
    return simulate(replace(settings, model=model, n_gpus=n_gpus, **changes))


def _sec_per_step(result: SimResult, warmup: int) -> float:
    """Seconds per step after warm-up (the published hours / 1000 steps is a mean)."""
    ends = result.step_end_s
    return float((ends[-1] - ends[warmup - 1]) / (len(ends) - warmup))


def end_to_end_rows(settings: SimConfig = PAPER_SETTING) -> list[ValidationRow]:
    """The end-to-end table: speed-up and seconds per step, 1.5B and 7B."""
    rows = []
    for model, n_gpus, sync_h, async_h in (("1.5B", 128, 41.0, 14.8), ("7B", 192, 57.7, 25.4)):
        sync, asyn = _run(settings, model, n_gpus, mode="sync"), _run(settings, model, n_gpus)
        w = settings.warmup_steps
        where = f"{model}, {n_gpus} H800"
        rows += [
            ValidationRow(
                f"{where}: async / sync training throughput",
                sync_h / async_h,
                asyn.effective_throughput / sync.effective_throughput,
                BLOG,
                f"{sync_h} h / {async_h} h",
            ),
            ValidationRow(
                f"{where}: sync seconds per step",
                sync_h * 3.6,
                _sec_per_step(sync, w),
                BLOG,
                f"{sync_h} h / 1000 steps",
            ),
            ValidationRow(
                f"{where}: async seconds per step",
                async_h * 3.6,
                _sec_per_step(asyn, w),
                BLOG,
                f"{async_h} h / 1000 steps",
            ),
        ]
    return rows


def interruptible_rows(settings: SimConfig = PAPER_SETTING) -> list[ValidationRow]:
    """The interruptible-generation ablation: reprefill vs drain on 4 nodes."""
    rows = []
    for model, gain in (("1.5B", 1.12), ("7B", 1.17)):
        inter = _run(settings, model, 32, weight_update="reprefill")
        drain = _run(settings, model, 32, weight_update="drain")
        rows.append(
            ValidationRow(
                f"{model}, 32 H800: generation throughput, reprefill / drain",
                gain,
                inter.generation_throughput / drain.generation_throughput,
                ABLATION,
            )
        )
    return rows


def scaling_rows(settings: SimConfig = PAPER_SETTING) -> list[ValidationRow]:
    """The strong-scaling figure's two claims, at its batch of 512 prompts x 16 answers."""
    big = replace(settings, prompts_per_step=512)
    small, large = _run(big, "7B", 64), _run(big, "7B", 512)
    short = replace(big, lengths=replace(big.lengths, max_new_tokens=15360))
    gain_16k = _run(short, "7B", 64).effective_throughput / _run(short, "7B", 64, mode="sync").effective_throughput
    gain_32k = small.effective_throughput / _run(big, "7B", 64, mode="sync").effective_throughput
    return [
        ValidationRow(
            "7B async, 512 x 16: throughput at 512 GPUs / (8 x at 64 GPUs)",
            1.0,
            large.effective_throughput / small.effective_throughput / 8,
            SCALING,
            "'near-linear': 1.0 stands for the claim",
        ),
        ValidationRow(
            "7B, 64 H800, 512 x 16: async/sync gain at 16K / gain at 32K",
            1.0,
            gain_16k / gain_32k,
            SCALING,
            "the claim is only '< 1': 1.0 is a bound",
        ),
    ]


def validation_rows(settings: SimConfig = PAPER_SETTING) -> list[ValidationRow]:
    """Every row (about 40 s on one core)."""
    return end_to_end_rows(settings) + interruptible_rows(settings) + scaling_rows(settings)


def format_validation(rows: list[ValidationRow]) -> str:
    lines = ["| figure | published | simulated | relative error | source |", "|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.name} | {r.published:.3g} | {r.simulated:.3g} | {r.rel_error:+.0%} | {r.source}{note} |")
    return "\n".join(lines)
