"""``areal-flow replay``: train a finished (or stopped) run's recorded steps again, with no rollout server.

From checkpoint A of the original run (its weights and optimizer state), each step B > A takes
the batch the schedule recorded (``schedule.py``: the same trajectories in the same order) and
runs the same trainer on it, with the original's lr schedule. The trainer has no random state
and its arithmetic does not depend on its thread count (``trainer/packed_forward.py``), so on
the same machine type every later checkpoint's weights come out bit for bit on all the cores the
replay has, however many the original trainer had: the replay prints ``v<N> <sha256> match`` (or
``DIFFERS``) for each checkpoint the original holds a hash of. With ``--set trainer.<key>=...`` the same data is trained under
another setting: a counterfactual replay, not an on-policy run, and its folder says so.

Across CPU kinds (or torch builds) the kernels differ, so the last bits may too: the replay names
the kind that recorded the run and the kind replaying it, and where a replay differs it says where
first (the first step whose loss, gradient norm or other trainer figure differs in any bit) and by how
much (the first tensor that differs, the largest absolute and relative differences); it stops there,
or with ``tolerant`` trains on to the end and says how far the final weights are from the original's.

The output folder is a run folder like any other: ``checkpoints/v*/``, ``metrics.parquet``,
``summary.json`` (``replay`` says of what, from where and whether counterfactual) and
``replay.png`` (loss, grad norm and clip fraction against the original's, step by step).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from transformers.utils import logging as hf_logging

from areal_core.experiment import ConfigError, ExperimentConfig, apply_overrides
from areal_core.models.digest import weights_sha256
from areal_core.models.loading import model_dtype
from areal_core.models.weights import load_model
from areal_core.numerics import cpu_kind, kind_label, require_repeatable, same_kernels, thread_invariant
from areal_core.run.checkpoints import RunCheckpoints, restore_weights
from areal_core.run.metrics import RunLog
from areal_core.run.schedule import ScheduleError, read_meta, read_step
from areal_core.storage import CheckpointStore, run_state, write_json_atomic
from areal_core.trainer.backends import make_trainer
from areal_core.trainer.published import as_base, stored_base, trainable

# what a counterfactual may change: the trainer's objective and optimisation, not what was trained
FIXED_TRAINER_KEYS = ("trainer.batch_size", "trainer.eta", "trainer.max_steps", "trainer.lora", "trainer.backend")
COMPARED = ("loss", "grad_norm", "clip_fraction")
# the trainer's figures of a step compared bit for bit with the original's: the first that differs
# says at which step an exact replay parted from the original
EXACT = ("loss", "grad_norm", "clip_fraction", "behav_weight_mean", "approx_kl", "importance_weight_mean")


class ReplayError(ValueError):
    """A replay that cannot run as asked (printed as one error line)."""


def _config(original: dict, overrides: dict) -> ExperimentConfig:
    for key in overrides:
        if not key.startswith("trainer.") or any(key == k or key.startswith(k + ".") for k in FIXED_TRAINER_KEYS):
            raise ReplayError(
                f"--set {key}: a replay trains the recorded batches again, so it may change the "
                f"trainer's settings only (trainer.*, except {', '.join(FIXED_TRAINER_KEYS)})"
            )
    try:
        return ExperimentConfig.model_validate(apply_overrides(original, overrides))
    except (ConfigError, ValueError) as e:
        raise ReplayError(f"--set: {e}") from None


def _model(cfg: ExperimentConfig, store: CheckpointStore, version: int, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer's model at checkpoint ``version``, in ``dtype``, built from the checkpoints alone (no
    warm start), as the trainer trains it."""
    base = stored_base(cfg.trainer, version)
    model = trainable(load_model(store.local_copy(base), dtype), cfg.trainer, cfg.seed)
    if base != version:
        restore_weights(store, model, version)
    return model


@dataclass
class _Original:
    """The run being replayed: its folder, config (with a counterfactual's overrides), schedule
    metadata, checkpoints and recorded step figures."""

    dir: Path
    cfg: ExperimentConfig
    overrides: dict
    meta: dict
    store: CheckpointStore
    metrics: pd.DataFrame | None
    last_step: int

    @property
    def counterfactual(self) -> bool:
        return bool(self.overrides)

    def hashes(self) -> dict[int, str]:
        """The weight hash of every step that recorded one."""
        m = self.metrics
        if m is None or "weights_sha256" not in m:
            return {}
        return {int(s): h for s, h in zip(m["step"], m["weights_sha256"]) if isinstance(h, str)}

    def rows(self) -> dict[int, dict]:
        return {} if self.metrics is None else {int(r["step"]): r for r in self.metrics.to_dict("records")}


def _read_original(run_dir: Path, out_dir: Path, from_step: int, overrides: dict) -> _Original:
    """The original run, or a :class:`ReplayError` saying why it cannot be replayed into ``out_dir``."""
    if out_dir.resolve() == run_dir.resolve():
        raise ReplayError("--out must be a new folder, not the original run's")
    if (out_dir / "summary.json").exists():
        raise ReplayError(f"{out_dir} already holds a run (summary.json); choose another --out")
    try:
        config = json.loads((run_dir / "config.json").read_text())
        meta = read_meta(run_dir)
    except (FileNotFoundError, ScheduleError) as e:
        raise ReplayError(f"{run_dir}: not a run folder that can be replayed ({e})") from None
    cfg = _config(config, overrides)
    store = CheckpointStore.from_config(cfg.storage, str(run_dir))
    if from_step not in store.versions():
        raise ReplayError(
            f"--from-step {from_step}: the run has no checkpoint v{from_step} "
            f"(it has {', '.join(f'v{v}' for v in store.versions()) or 'none'})"
        )
    metrics = pd.read_parquet(run_dir / "metrics.parquet") if (run_dir / "metrics.parquet").exists() else None
    last = int(metrics["step"].max()) if metrics is not None and len(metrics) else from_step
    return _Original(run_dir, cfg, overrides, meta, store, metrics, last)


@dataclass
class _Verdicts:
    """What a replay finds, step by step: the checkpoints' hashes against the original's, the first
    step whose figures differ, and (tolerant) the final weights' distance."""

    original: _Original
    say: Callable[[str], None]
    hint: str
    checks: list[dict] = field(default_factory=list)
    first_difference: dict | None = None
    final_distance: dict | None = None

    def figures(self, step: int, row: dict, recorded: dict | None) -> None:
        if self.first_difference is None and not self.original.counterfactual:
            self.first_difference = _figure_difference(step, recorded, row)
            if self.first_difference is not None:
                self.say(_difference_line(self.first_difference))

    def checkpoint(self, step: int, digest: str, model) -> bool:
        """Check the weights at ``step``; whether an exact replay differs here."""
        o = self.original
        check = _check(step, digest, o.hashes().get(step), o.counterfactual, self.say, hint=self.hint)
        self.checks.append(check)
        differs = check["original_sha256"] is not None and not check["match"] and not o.counterfactual
        if differs:
            check["weights"] = _compare_with_original(o.cfg, o.store, step, model, self.say)
        return differs

    def finish(self, tolerant: bool) -> None:
        if not (tolerant and self.checks and not self.checks[-1]["match"]) or self.original.counterfactual:
            return
        self.final_distance = self.checks[-1].get("weights")
        if self.final_distance:
            self.say(
                f"final weights (v{self.checks[-1]['version']}) against the original's: relative L2 distance "
                f"{self.final_distance['relative_l2']:.3g}, max abs {self.final_distance['max_abs']:.3g}"
            )


def replay(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    from_step: int = 0,
    to_step: int | None = None,
    overrides: dict | None = None,
    threads: int | None = None,
    tolerant: bool = False,
    say: Callable[[str], None] = print,
) -> dict:
    """Replay ``run_dir`` from checkpoint ``from_step`` to step ``to_step`` (default: its last recorded
    step) into ``out_dir``; returns the summary (also ``out_dir/summary.json``).

    ``threads``: the trainer's torch threads (None: all the cores where the trainer's arithmetic does
    not depend on the count, else the original trainer's; every checkpoint's hash says whether the
    weights came out the same). ``tolerant``: an exact replay whose weights differ from the original's
    trains on to ``to_step`` (and measures how far it drifts) instead of stopping at the first
    checkpoint that differs."""
    t0 = time.perf_counter()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    original = _read_original(run_dir, out_dir, from_step, dict(overrides or {}))
    to_step = original.last_step if to_step is None else to_step
    if not from_step < to_step <= original.last_step:
        raise ReplayError(
            f"--to-step {to_step}: the run recorded steps 1..{original.last_step}; give a step after "
            f"--from-step {from_step} and at most {original.last_step}"
        )
    require_repeatable()
    hf_logging.disable_progress_bar()  # (loading each checkpoint would draw one)
    kinds = {"recorded_on": original.meta.get("numerics"), "replayed_on": cpu_kind()}
    say(_kinds_line(**kinds))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(str(out_dir / "config.json"), original.cfg.model_dump(mode="json"))
    # the original trainer's dtype (model.dtype auto resolves by machine: a replay elsewhere keeps the original's)
    meta = original.meta
    dtype = getattr(torch, meta["dtype"]) if "dtype" in meta else model_dtype(original.cfg.model)[0]
    model = _model(original.cfg, original.store, from_step, dtype)
    runlog = RunLog(out_dir)
    with contextlib.ExitStack() as stack:
        used_threads = _use_threads(_replay_threads(threads, dtype, meta, say), stack)
        verdicts = _Verdicts(original, say, _threads_hint(original.cfg, meta, used_threads))
        trainer = _trainer_at(original, model, from_step, out_dir, stack)
        ckpts = _replay_store(original, model, from_step, out_dir)
        with ckpts:
            _train_recorded(original, trainer, model, ckpts, runlog, verdicts, from_step, to_step, tolerant)
        runlog.flush()
    verdicts.finish(tolerant)
    summary = _summary(original, verdicts, kinds, from_step, to_step, tolerant, used_threads, time.perf_counter() - t0)
    write_json_atomic(str(out_dir / "summary.json"), summary)
    if original.metrics is not None:
        plot_comparison(original.metrics, pd.DataFrame(runlog.metrics), out_dir / "replay.png", original.counterfactual)
    return summary


def _use_threads(threads: int | None, stack: contextlib.ExitStack) -> int:
    """Set torch's thread count for the block (it is the process's: put back what it was); the count used."""
    if threads:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def _trainer_at(original: _Original, model, step: int, out_dir: Path, stack: contextlib.ExitStack):
    """The original's trainer with its state at checkpoint ``step`` (a counterfactual's optimizer settings)."""
    trainer = make_trainer(original.cfg, model, int(original.meta["total_steps"]), out_dir, stack)
    try:
        state = original.store.read_file(step, run_state.TRAINER)
    except FileNotFoundError:
        raise ReplayError(
            f"--from-step {step}: checkpoint v{step} holds no trainer state ({run_state.TRAINER}); start from "
            "a checkpoint the run wrote whole (a campaign drops it from the runs it finished, unless --keep-run-state)"
        ) from None
    trainer.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    _take_optim_settings(trainer, original.cfg)
    return trainer


def _replay_store(original: _Original, model, step: int, out_dir: Path) -> RunCheckpoints:
    """The replay's own checkpoints (whole weights, in its folder), starting with ``step``'s."""
    storage = original.cfg.storage
    store = CheckpointStore.from_config(
        storage.model_copy(update={"url": None, "format": "full", "keep_last": None}), str(out_dir)
    )
    with as_base(model):
        store.publish(step, model, None, meta={"step": step, "replay_of": str(original.dir)})
    full = storage.model_copy(update={"format": "full"})
    return RunCheckpoints(store, full, None, last_step=step, on_written=lambda r: None)


def _train_recorded(original, trainer, model, ckpts, runlog, verdicts, from_step, to_step, tolerant) -> None:
    """Train the recorded steps in order, checking each against the original; stop at the first
    checkpoint that differs unless ``tolerant``."""
    hashes, recorded = original.hashes(), original.rows()
    with ThreadPoolExecutor(1, thread_name_prefix="schedule-reader") as reader:
        # the next step's batch is read while this one trains (parquet decoding leaves the GIL)
        ahead = reader.submit(read_step, original.dir, from_step + 1)
        for step in range(from_step + 1, to_step + 1):
            batch, step_meta = ahead.result()
            if step < to_step:
                ahead = reader.submit(read_step, original.dir, step + 1)
            if step_meta["version"] != step - 1:
                raise ReplayError(
                    f"schedule step {step} was trained by version {step_meta['version']}, expected {step - 1}"
                )
            row = {"step": step, "version": step, **trainer.step(batch, step - 1).metrics}
            verdicts.figures(step, row, recorded.get(step))
            differs = False
            if step in hashes or step == to_step:
                row["weights_sha256"] = weights_sha256(model)
                ckpts.write(step, model, {})
                differs = verdicts.checkpoint(step, row["weights_sha256"], model)
            runlog.log_step(row, [], flush=False)
            if differs and not tolerant:
                verdicts.say(f"stopped at v{step}: the replay differs (--tolerant trains on and measures the drift)")
                return


def _summary(original: _Original, verdicts: _Verdicts, kinds, from_step, to_step, tolerant, threads, wall) -> dict:
    cf = original.counterfactual
    note = (
        "a counterfactual replay: the original run's trajectories trained under another setting; not an on-policy run"
        if cf
        else "an exact replay of the original run's training steps"
    )
    return {
        "replay": {
            "of": str(original.dir),
            "from_step": from_step,
            "to_step": to_step,
            "counterfactual": cf,
            "overrides": original.overrides,
            "note": note,
        },
        "name": f"{original.cfg.name}-replay",
        "steps": to_step,
        "checkpoints": verdicts.checks,
        "all_match": all(c["match"] for c in verdicts.checks if c["original_sha256"] is not None),
        "first_difference": verdicts.first_difference,
        "final_distance": verdicts.final_distance,
        "tolerant": tolerant,
        **kinds,
        "same_kernels": kinds["recorded_on"] is not None and same_kernels(kinds["recorded_on"], kinds["replayed_on"]),
        "wall_time_s": wall,
        "threads": threads,
        "original_threads": int(original.meta["trainer_threads"]),
        **_original_times(original.dir),
    }


def _take_optim_settings(trainer, cfg: ExperimentConfig) -> None:
    """The optimizer's saved state carries the original's hyperparameters: a counterfactual's
    ``trainer.optim`` settings replace them (the moments stay)."""
    o, opt = cfg.trainer.optim, getattr(trainer, "optimizer", None)
    if opt is None:
        return
    for group in opt.param_groups:
        group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    trainer.scheduler.base_lrs = [o.lr] * len(opt.param_groups)
    for group, factor in zip(opt.param_groups, [f(trainer.scheduler.last_epoch) for f in trainer.scheduler.lr_lambdas]):
        group["lr"] = o.lr * factor


def _replay_threads(threads: int | None, dtype: torch.dtype, meta: dict, say) -> int | None:
    """The replay's thread count: as asked, or all the cores where the arithmetic in ``dtype`` does not
    depend on the count (``numerics.thread_invariant``), else the original trainer's (said, with why)."""
    invariant, why = thread_invariant(dtype)
    original = int(meta["trainer_threads"])
    if not invariant and int(meta.get("lent_threads", 0)):
        say(f"the original trainer borrowed idle cores although {why}: its steps may not replay bit for bit")
    if threads is not None or invariant:
        return threads
    say(f"{why}: replaying on the original trainer's {original} thread(s) (--threads to choose)")
    return original


def _threads_hint(cfg: ExperimentConfig, meta: dict, used: int) -> str:
    """What to try when an exact replay on ``used`` threads differs: the original's thread count, where
    this one ran another (a trainer other than the torch one may round by thread)."""
    original = int(meta["trainer_threads"])
    if used == original:
        return ""
    return f" (the original {cfg.trainer.backend.kind} trainer ran {original} thread(s): try --threads {original})"


def _check(step: int, digest: str, original: str | None, counterfactual: bool, say, hint: str = "") -> dict:
    match = original is not None and digest == original
    if original is None:
        verdict = "(the original recorded no hash at this step)"
    elif counterfactual:
        verdict = "same as the original" if match else "differs from the original (counterfactual)"
    else:
        verdict = "match" if match else "DIFFERS" + hint
    say(f"v{step} {digest} {verdict}")
    return {"version": step, "sha256": digest, "original_sha256": original, "match": match}


def _kinds_line(recorded_on: dict | None, replayed_on: dict) -> str:
    here = kind_label(replayed_on)
    if recorded_on is None:
        return f"replaying on {here}; the run did not record its CPU kind"
    if same_kernels(recorded_on, replayed_on):
        return f"recorded and replayed on {here}: the same kernels, so bit for bit is expected"
    return (
        f"recorded on {kind_label(recorded_on)}; replaying on {here}: other kernels, whose last bits may "
        "differ (--tolerant trains on past a difference and measures the drift)"
    )


def _figure_difference(step: int, original: dict | None, row: dict) -> dict | None:
    """The first of the step's trainer figures (``EXACT``) whose bits differ from the original's, or None."""
    if original is None:
        return None
    for key in EXACT:
        a, b = original.get(key), row.get(key)
        if not isinstance(a, float) or not isinstance(b, float) or (math.isnan(a) and math.isnan(b)):
            continue
        if a != b:
            return {"step": step, "figure": key, "original": a, "replay": b, **_abs_rel(abs(a - b), abs(a))}
    return None


def _abs_rel(diff: float, scale: float) -> dict:
    return {"abs": diff, "rel": diff / scale if scale > 0 else math.inf}


def _difference_line(d: dict) -> str:
    return (
        f"step {d['step']}: first difference from the original: {d['figure']} {d['original']!r} -> "
        f"{d['replay']!r} (abs {d['abs']:.3g}, rel {d['rel']:.3g})"
    )


def weight_difference(replayed: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> dict:
    """How far ``replayed`` lies from ``original`` (tensors by name, the same names): the first tensor
    in name order that differs, how many differ, the largest absolute difference, the largest
    relative one (``|a - b| / |b|`` over elements with ``b != 0``) and the relative L2 distance of all
    the weights together, ``||a - b|| / ||b||``."""
    if replayed.keys() != original.keys():
        raise ValueError(f"the weights hold other tensors: {sorted(replayed.keys() ^ original.keys())[:5]}")
    first, n_diff, max_abs, max_rel, sq_diff, sq_ref = None, 0, 0.0, 0.0, 0.0, 0.0
    for name in sorted(original):
        a, b = replayed[name].detach().double().cpu(), original[name].detach().double().cpu()
        d = (a - b).abs()
        sq_diff += float((d * d).sum())
        sq_ref += float((b * b).sum())
        if not torch.equal(a, b):
            n_diff += 1
            first = first or name
            max_abs = max(max_abs, float(d.max()))
            nz = b != 0
            if nz.any():
                max_rel = max(max_rel, float((d[nz] / b[nz].abs()).max()))
    return {
        "first_tensor": first,
        "tensors_differing": n_diff,
        "tensors": len(original),
        "max_abs": max_abs,
        "max_rel": max_rel,
        "relative_l2": math.sqrt(sq_diff / sq_ref) if sq_ref > 0 else 0.0,
    }


def _compare_with_original(cfg: ExperimentConfig, store: CheckpointStore, version: int, model, say) -> dict | None:
    """The replayed weights against the original's checkpoint ``version`` (said in one line), or None
    where the original no longer holds it (``storage.keep_last``)."""
    if version not in store.versions():
        say(f"v{version}: the original's checkpoint is no longer stored, so its tensors cannot be compared")
        return None
    original = _model(cfg, store, version, next(model.parameters()).dtype).state_dict()
    d = weight_difference(model.state_dict(), original)
    say(
        f"v{version}: {d['tensors_differing']} of {d['tensors']} tensors differ, first {d['first_tensor']}; "
        f"max abs {d['max_abs']:.3g}, max rel {d['max_rel']:.3g}, relative L2 distance {d['relative_l2']:.3g}"
    )
    return d


def _original_times(run_dir: Path) -> dict:
    """The original run's wall time and its training loop's (None for a run that did not finish)."""
    path = run_dir / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {}
    return {"original_wall_time_s": s.get("wall_time_s"), "original_rl_time_s": s.get("rl_time_s")}


def plot_comparison(original: pd.DataFrame, replayed: pd.DataFrame, path: Path, counterfactual: bool) -> None:
    """Loss, grad norm and clip fraction per step: the original and the replay, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COMPARED), figsize=(4.2 * len(COMPARED), 3.2))
    label = "counterfactual replay" if counterfactual else "replay"
    for ax, key in zip(axes, COMPARED):
        for df, name, style in ((original, "original", "-"), (replayed, label, "--")):
            if key in df:
                ax.plot(df["step"], df[key].astype(float), style, label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
