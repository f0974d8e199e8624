"""The AReaL staleness gate (paper eq. 3).

With batch size ``B``, current policy version ``i`` and maximum staleness
``eta``, the ``N_r``-th generation request (1-based, counting the one being
admitted) may be submitted only while ``floor((N_r - 1) / B) <= i + eta``.
Equivalently, at version ``i`` at most ``(i + eta + 1) * B`` requests have ever
been admitted; ``eta = 0`` is synchronous RL (exactly ``B`` per version).
"""

from __future__ import annotations

import operator


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def staleness_allows(n_submitted: int, version: int, batch_size: int, eta: int) -> bool:
    """Return True if one more trajectory may be submitted after ``n_submitted`` were.

    ``version`` is the current policy version, ``batch_size`` the number of
    trajectories consumed per training step and ``eta`` the maximum staleness.
    Raises ValueError for negative ``n_submitted``/``version``/``eta`` or
    ``batch_size <= 0``.
    """
    n_submitted = _as_int(n_submitted, "n_submitted")
    version = _as_int(version, "version")
    batch_size = _as_int(batch_size, "batch_size")
    eta = _as_int(eta, "eta")
    if n_submitted < 0:
        raise ValueError(f"n_submitted must be >= 0, got {n_submitted}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    n_r = n_submitted + 1
    return (n_r - 1) // batch_size <= version + eta
