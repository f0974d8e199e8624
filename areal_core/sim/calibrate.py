"""Fit a `CostModel` to measured points (`areal_core/sim/measure.py` measures them here).

`calibrate_from(measurements)` takes a dict:

    {
      "decode":  [{"batch": 8, "context_tokens": 4096, "step_s": 0.012}, ...],
      "prefill": [{"tokens": 512, "tokens_sq": 262144, "time_s": 0.03}, ...],
      "train":   [{"tokens": 8192, "tokens_sq": 1.6e7, "n_devices": 1, "time_s": 1.9}, ...],
      "weight_update_s": [0.21, 0.19, ...],          # or one number
      "kv_capacity_tokens": 200000,
      # optional: "train_scaling_eff" (fitted when the train points have several
      # n_devices, else 0.97), "colocate_switch_s" (default 0)
    }

Every fit is least squares on relative residuals (each point weighs 1 / its time), so
microsecond and second points count alike, with coefficients kept >= 0.

* decode: step = overhead + max(weight_read + kv * C, per_seq * b + per_ctx * C), a
  maximum of two planes, fitted by alternating assignment (each point goes to the
  plane that predicts more, each plane is refitted by least squares on its points)
  from a split at the median batch. If one regime has too few points (a CPU is
  compute-bound everywhere), the other plane alone is fitted.
* prefill: time = overhead + per_token * tokens + per_token_sq * tokens_sq
  (`tokens_sq` defaults to tokens**2: one sequence per point).
* train: time = overhead + (per_token * tokens + per_token_sq * tokens_sq) / (n * eff(n)),
  eff(n) = eff ** log2(n); eff itself by a grid search when it is not given.
* weight update: the mean.
"""

from __future__ import annotations

import numpy as np

from areal_core.sim.cost import CostModel


def calibrate_from(measurements: dict) -> CostModel:
    for key in ("decode", "prefill", "train", "weight_update_s", "kv_capacity_tokens"):
        if key not in measurements:
            raise ValueError(f"measurements[{key!r}] is missing")
    train_points = _points(measurements, "train", ("tokens", "time_s"))
    if "train_scaling_eff" in measurements:
        eff = float(measurements["train_scaling_eff"])
        if not 0 < eff <= 1:
            raise ValueError(f"measurements['train_scaling_eff'] must be in (0, 1], got {eff}")
    else:
        eff = _fit_scaling_eff(train_points)
    decode = _fit_decode(_points(measurements, "decode", ("batch", "context_tokens", "step_s")))
    prefill = _fit_prefill(_points(measurements, "prefill", ("tokens", "time_s")))
    train = _fit_train(train_points, eff)
    updates = np.atleast_1d(np.asarray(measurements["weight_update_s"], dtype=float))
    if updates.size == 0 or np.any(updates < 0):
        raise ValueError("measurements['weight_update_s'] must hold non-negative seconds")
    capacity = int(measurements["kv_capacity_tokens"])
    if capacity < 1:
        raise ValueError(f"measurements['kv_capacity_tokens'] must be >= 1, got {capacity}")
    return CostModel(
        **decode,
        **prefill,
        kv_capacity_tokens=capacity,
        **train,
        train_scaling_eff=eff,
        weight_update_s=float(updates.mean()),
        colocate_switch_s=float(measurements.get("colocate_switch_s", 0.0)),
    )


def _points(measurements: dict, key: str, required: tuple[str, ...]) -> list[dict]:
    points = measurements[key]
    if not points:
        raise ValueError(f"measurements[{key!r}] holds no points")
    for i, p in enumerate(points):
        for name in required:
            if name not in p:
                raise ValueError(f"measurements[{key!r}][{i}] lacks {name!r}")
            if p[name] < 0:
                raise ValueError(f"measurements[{key!r}][{i}][{name!r}] must be >= 0, got {p[name]}")
    return points


def _lstsq_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative residuals with coefficients >= 0 (drop a negative one and refit)."""
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    x, y = x * w[:, None], y * w
    active = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        if active.any():
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = active & (coef < 0)
        if not negative.any():
            return coef
        active[np.argmin(np.where(active, coef, np.inf))] = False


def _fit_decode(points: list[dict]) -> dict:
    b = np.array([p["batch"] for p in points], dtype=float)
    c = np.array([p["context_tokens"] for p in points], dtype=float)
    t = np.array([p["step_s"] for p in points], dtype=float)
    one = np.ones_like(t)
    mem_x = np.column_stack([one, c])  # intercept = overhead + weight read
    cmp_x = np.column_stack([one, b, c])  # intercept = overhead
    compute = b > np.median(b)
    mem_coef = cmp_coef = None
    for _ in range(100):
        if (~compute).sum() < 2 or compute.sum() < 3:
            break
        mem_coef = _lstsq_nonneg(mem_x[~compute], t[~compute])
        cmp_coef = _lstsq_nonneg(cmp_x[compute], t[compute])
        # the overhead is shared: memory's intercept cannot be below compute's
        mem_coef[0] = max(mem_coef[0], cmp_coef[0])
        new = cmp_x @ cmp_coef > mem_x @ mem_coef
        if np.array_equal(new, compute):
            break
        compute = new
    else:
        mem_coef = cmp_coef = None
    if mem_coef is None or (~compute).sum() < 2 or compute.sum() < 3:
        return _fit_decode_one_plane(mem_x, cmp_x, t)
    overhead = cmp_coef[0]
    return {
        "decode_overhead_s": overhead,
        "decode_weight_read_s": mem_coef[0] - overhead,
        "decode_kv_read_s_per_token": mem_coef[1],
        "decode_flop_s_per_seq": cmp_coef[1],
        "decode_flop_s_per_ctx_token": cmp_coef[2],
    }


def _fit_decode_one_plane(mem_x: np.ndarray, cmp_x: np.ndarray, t: np.ndarray) -> dict:
    cmp_coef = _lstsq_nonneg(cmp_x, t)
    mem_coef = _lstsq_nonneg(mem_x, t)
    cmp_err = np.sum(((cmp_x @ cmp_coef - t) / t) ** 2)
    mem_err = np.sum(((mem_x @ mem_coef - t) / t) ** 2)
    if cmp_err <= mem_err:  # compute-bound everywhere: no memory term
        return {
            "decode_overhead_s": cmp_coef[0],
            "decode_weight_read_s": 0.0,
            "decode_kv_read_s_per_token": 0.0,
            "decode_flop_s_per_seq": cmp_coef[1],
            "decode_flop_s_per_ctx_token": cmp_coef[2],
        }
    return {
        "decode_overhead_s": mem_coef[0],
        "decode_weight_read_s": 0.0,
        "decode_kv_read_s_per_token": mem_coef[1],
        "decode_flop_s_per_seq": 0.0,
        "decode_flop_s_per_ctx_token": 0.0,
    }


def _fit_prefill(points: list[dict]) -> dict:
    tokens = np.array([p["tokens"] for p in points], dtype=float)
    sq = np.array([p.get("tokens_sq", p["tokens"] ** 2) for p in points], dtype=float)
    t = np.array([p["time_s"] for p in points], dtype=float)
    o, per_token, per_sq = _lstsq_nonneg(np.column_stack([np.ones_like(t), tokens, sq]), t)
    return {"prefill_overhead_s": o, "prefill_s_per_token": per_token, "prefill_s_per_token_sq": per_sq}


def _train_arrays(points: list[dict]) -> tuple[np.ndarray, ...]:
    tokens = np.array([p["tokens"] for p in points], dtype=float)
    sq = np.array([p.get("tokens_sq", p["tokens"] ** 2) for p in points], dtype=float)
    n = np.array([p.get("n_devices", 1) for p in points], dtype=float)
    if np.any(n < 1):
        raise ValueError("measurements['train'][*]['n_devices'] must be >= 1")
    return tokens, sq, n, np.array([p["time_s"] for p in points], dtype=float)


def _train_coef(points: list[dict], eff: float) -> tuple[np.ndarray, float]:
    """(overhead, per_token, per_token_sq) and the sum of squared relative residuals."""
    tokens, sq, n, t = _train_arrays(points)
    scale = n * eff ** np.log2(n)
    x = np.column_stack([np.ones_like(t), tokens / scale, sq / scale])
    coef = _lstsq_nonneg(x, t)
    return coef, float(np.sum(((x @ coef - t) / t) ** 2))


def _fit_scaling_eff(points: list[dict]) -> float:
    """The per-doubling efficiency that fits points taken at several device counts best (0.97
    when they were all taken at one count: nothing to fit it from)."""
    if len({p.get("n_devices", 1) for p in points}) < 2:
        return 0.97
    grid = np.linspace(0.25, 1.0, 301)
    return float(grid[int(np.argmin([_train_coef(points, e)[1] for e in grid]))])


def _fit_train(points: list[dict], eff: float) -> dict:
    o, per_token, per_sq = _train_coef(points, eff)[0]
    return {"train_step_overhead_s": o, "train_device_s_per_token": per_token, "train_device_s_per_token_sq": per_sq}


def fit_errors(measurements: dict, cost: CostModel) -> dict:
    """Median and largest relative error of `cost` on each kind of measured point."""

    def summary(pred, meas) -> dict:
        err = np.abs(np.asarray(pred) / np.asarray(meas) - 1)
        return {"n": int(err.size), "median_rel_error": float(np.median(err)), "max_rel_error": float(err.max())}

    d, p, t = measurements["decode"], measurements["prefill"], measurements["train"]
    return {
        "decode": summary([cost.decode_step_s(x["batch"], x["context_tokens"]) for x in d], [x["step_s"] for x in d]),
        "prefill": summary(
            [cost.prefill_s(x["tokens"], x.get("tokens_sq", x["tokens"] ** 2)) for x in p], [x["time_s"] for x in p]
        ),
        "train": summary(
            [cost.train_s(x["tokens"], x.get("tokens_sq", x["tokens"] ** 2), x.get("n_devices", 1)) for x in t],
            [x["time_s"] for x in t],
        ),
    }
