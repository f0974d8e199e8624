"""A campaign that decides: every setting of a grid trained with the same seeds, then a seed more at a
time (``until_clear``) of the baseline and of each setting whose paired difference to it is still
unclear, until every difference is clear or the budget is spent (``run/decide.py``). The decision is
written as a file after every seed (the decision so far, then the final one) and drawn. A setting once
clear runs no further seed: another would only cost.

Each run lives in ``OUT/<setting>-s<seed>``. A campaign started again over the same folder reuses every
finished run whose config and code (``folder.code_version``) are those it would run now, and continues a
run it stopped in from that run's latest checkpoint, so a stopped campaign goes on where it stopped and a
finished one reports again without training. Once a run has finished, the optimizer state is dropped
from its checkpoints (two thirds of their bytes; ``keep_run_state`` keeps it): a campaign of 35 runs of
a 135M model would otherwise hold 100 GB, and a decided run is not continued.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_core.run.decide import Budget, Comparison, compare, next_seed, unclear
from areal_core.run.folder import code_version
from areal_core.storage.config_keys import WHERE_KEYS, config_differences
from areal_core.storage.fsutil import write_text_atomic

OUTCOMES = {
    "accuracy_after": "held-out accuracy after RL",
    "accuracy_gain": "held-out accuracy gain (after - before)",
}


@dataclass
class CampaignPlan:
    """``points``: (setting label, config overrides); ``baseline``: the label differences are taken to."""

    points: list[tuple[str, dict]]
    baseline: str
    seeds: int = 3  # seeds every setting runs before any decision
    until_clear: bool = False  # add seeds (of the baseline and the unclear settings) while a difference is unclear
    budget: Budget = field(default_factory=Budget)
    margin: float = 0.02  # differences narrower than this on each side count as the same
    outcome: str = "accuracy_after"
    keep_run_state: bool = False  # keep finished runs' optimizer state (to continue or replay them)

    def __post_init__(self) -> None:
        labels = [label for label, _ in self.points]
        if self.baseline not in labels:
            raise ValueError(f"baseline {self.baseline!r} is not one of the campaign's settings: {', '.join(labels)}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"the campaign's settings must differ: {labels}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {self.outcome!r}")
        if self.seeds < 1 or self.margin <= 0:
            raise ValueError(f"a campaign needs seeds >= 1 and margin > 0, got {self.seeds} and {self.margin}")


def run_dir_of(out_dir: str | Path, label: str, seed: int) -> Path:
    """``OUT/<setting>-s<seed>``: a folder of its own (and a name of its own in the UI) for every run."""
    return Path(out_dir) / f"{label}-s{seed}"


class CampaignFolderError(ValueError):
    """A run's folder holds a run the campaign cannot reuse (another config or code)."""


def _refuse(run_dir: Path, why: str) -> CampaignFolderError:
    return CampaignFolderError(
        f"{run_dir} holds a run the campaign cannot reuse: {why}; remove it or use another --out"
    )


def reusable(run_dir: Path, config: dict, code: dict) -> bool:
    """Whether ``run_dir`` holds a finished run (summary.json) of ``config`` (as config.json holds it;
    where its servers and reward workers were may differ: ``config_keys.WHERE_KEYS``) at the code
    ``code``; False where it holds nothing yet or a run that did not finish (:func:`stopped_at`). A
    folder that holds another run is a :class:`CampaignFolderError` saying what differs (a campaign
    never trains over a run)."""
    if not (run_dir / "config.json").is_file():
        return False
    differ = config_differences(json.loads((run_dir / "config.json").read_text()), config, may_differ=WHERE_KEYS)
    if differ:
        raise _refuse(run_dir, f"its config differs from the campaign's in {', '.join(differ[:10])}")
    if not (run_dir / "summary.json").is_file():
        return False
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("code") != code:
        raise _refuse(run_dir, f"it ran other code ({summary.get('code')}, the campaign runs {code})")
    return True


def drop_run_state(run_dir: Path, config: dict) -> int:
    """Drop the optimizer state from the checkpoints of the finished run in ``run_dir``
    (``run_state.drop_trainer_state``); the bytes freed (0 where it was dropped before)."""
    from areal_core.storage import CheckpointStore  # (torch: imported only where a run finished)
    from areal_core.storage.config import StorageConfig
    from areal_core.storage.run_state import drop_trainer_state

    return drop_trainer_state(CheckpointStore.from_config(StorageConfig(**config.get("storage", {})), str(run_dir)))


def stopped_at(run_dir: Path, config: dict, code: dict) -> int | None:
    """The checkpoint version a run of ``config`` that stopped in ``run_dir`` continues from; None where
    the folder holds no checkpoint (the run starts afresh). A stopped run whose checkpoint was written by
    other code, or does not say by which, is a :class:`CampaignFolderError`: resuming it would give the
    run steps of two codes."""
    if not (run_dir / "config.json").is_file():
        return None
    from areal_core.storage import CheckpointStore  # (torch: imported only where a run stopped)
    from areal_core.storage.config import StorageConfig
    from areal_core.storage.run_state import ResumeError, check_resumable

    store = CheckpointStore.from_config(StorageConfig(**config.get("storage", {})), str(run_dir))
    try:
        found = check_resumable(store, config)
    except ResumeError as e:
        raise _refuse(run_dir, f"it stopped and cannot be continued ({e})") from None
    if found is None:
        return None
    version, state = found
    if state.get("code") != code:
        other = state.get("code")
        by = f"written by other code ({other}, the campaign runs {code})" if other else "which does not name its code"
        raise _refuse(run_dir, f"it stopped at v{version}, {by}")
    return version


def outcome_of(run_dir: Path, outcome: str) -> float:
    s = json.loads((run_dir / "summary.json").read_text())
    return s["accuracy_after"] - s["accuracy_before"] if outcome == "accuracy_gain" else s[outcome]


def run_campaign(
    plan: CampaignPlan,
    out_dir: str | Path,
    config_of: Callable[[dict], dict],
    train: Callable[[str, int, dict, Path, bool], None],
    say: Callable[[str], None] = print,
    on_decision: Callable[[dict], None] = lambda decision: None,
) -> dict:
    """Train ``plan``'s settings seed by seed into ``out_dir`` and decide. ``config_of(overrides)``: the
    config (as a run's config.json holds it) a run with those overrides gets; ``train(label, seed,
    overrides, run_dir, resume)`` trains one run (``resume``: continue it from its latest checkpoint).
    After every seed the decision so far is written to ``out_dir/decision.json`` (``final`` false
    while seeds are still to come) and handed to ``on_decision`` (the flow's report): a campaign of
    hours shows where it stands. Returns the final decision."""
    t0, code = time.monotonic(), code_version()
    outcomes: dict[str, dict[int, float]] = {label: {} for label, _ in plan.points}
    trained = reused = 0
    done, seeds = 0, plan.seeds
    running = plan.points  # the settings the next seeds run: all of them first
    while True:
        for seed in range(done, seeds):
            for label, overrides in running:
                ov = {**overrides, "seed": seed}
                run_dir, config = run_dir_of(out_dir, label, seed), config_of(ov)
                if reusable(run_dir, config, code):
                    reused += 1
                    say(f"{label} seed {seed}: reused ({run_dir})")
                else:
                    at = stopped_at(run_dir, config, code)
                    if at is not None:
                        say(f"{label} seed {seed}: continued from its checkpoint v{at} ({run_dir})")
                    train(label, seed, ov, run_dir, at is not None)
                    trained += 1
                freed = 0 if plan.keep_run_state else drop_run_state(run_dir, config)
                if freed:
                    say(f"{label} seed {seed}: its optimizer state dropped from its checkpoints ({freed / 1e9:.2f} GB)")
                outcomes[label][seed] = outcome_of(run_dir, plan.outcome)
        done = seeds
        comparisons = compare(outcomes, plan.baseline, plan.margin)
        if plan.until_clear:
            why = next_seed(comparisons, seeds, trained + reused, (time.monotonic() - t0) / 60, plan.budget)
        else:
            why = "a fixed number of seeds (--until-clear adds seeds while a difference is unclear)"
        decision = _decision(plan, comparisons, outcomes, why, trained, reused, code)
        write_text_atomic(str(Path(out_dir) / "decision.json"), json.dumps(decision, indent=2) + "\n")
        on_decision(decision)
        if why is not None:
            return decision
        seeds += 1
        left = unclear(comparisons)
        running = [(label, ov) for label, ov in plan.points if label == plan.baseline or label in left]
        say(still_unclear(decision))


def still_unclear(decision: dict) -> str:
    """Where a campaign that is not done stands: the settings still unclear and the seed that runs next."""
    left = [s["label"] for s in decision["settings"] if s["verdict"] == "unclear"]
    return f"still unclear: {', '.join(left)}; seed {decision['seeds']} next, of them and the baseline {decision['baseline']}"


def _decision(plan, comparisons: list[Comparison], outcomes, why, trained, reused, code) -> dict:
    def iv(i):
        return None if i is None else {"mean": i.mean, "lo": i.lo, "hi": i.hi, "n": i.n}

    return {
        "outcome": plan.outcome,
        "outcome_label": OUTCOMES[plan.outcome],
        "baseline": plan.baseline,
        "margin": plan.margin,
        "seeds": max(len(v) for v in outcomes.values()),
        "final": why is not None,  # false: the decision so far, more seeds to come
        "stopped_because": why,
        "runs_trained": trained,
        "runs_reused": reused,
        "code": code,
        "settings": [
            {
                "label": c.label,
                "outcome": iv(c.outcome),
                "difference": iv(c.difference),
                "verdict": c.verdict,
                "by_seed": {str(s): v for s, v in sorted(outcomes[c.label].items())},
                "overrides": dict(plan.points)[c.label],
            }
            for c in comparisons
        ],
    }
