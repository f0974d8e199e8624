"""Micro-batch allocation: padding-free dynamic packing and the fixed-split baseline."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _lengths(seqlens) -> list[int]:
    if isinstance(seqlens, torch.Tensor):
        if seqlens.dim() != 1:
            raise ValueError(f"seqlens must be 1-D, got a tensor of shape {tuple(seqlens.shape)}")
        if seqlens.is_floating_point() or seqlens.is_complex():
            raise TypeError(f"seqlens must hold integers, got dtype {seqlens.dtype}")
        seqlens = seqlens.tolist()
    lens = [_as_int(v, f"seqlens[{i}]") for i, v in enumerate(seqlens)]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"seqlens[{i}] is negative ({n})")
    return lens


def allocate_microbatches(seqlens: Sequence[int] | torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Pack sequences into micro-batches of at most ``max_tokens`` tokens (first-fit decreasing).

    Indices are sorted by length, longest first (ties keep input order); each
    goes into the first micro-batch with room for it, else a new one. Returns
    lists of indices into ``seqlens`` (each index exactly once, within a group
    in placement order). Raises ValueError if a sequence alone exceeds the budget.
    """
    max_tokens = _as_int(max_tokens, "max_tokens")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    lens = _lengths(seqlens)
    for i, n in enumerate(lens):
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has length {n}, which exceeds the micro-batch budget max_tokens={max_tokens}"
            )
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        for g, used in enumerate(totals):
            if used + lens[i] <= max_tokens:
                groups[g].append(i)
                totals[g] = used + lens[i]
                break
        else:
            groups.append([i])
            totals.append(lens[i])
    return groups


def allocate_shared_prompt_microbatches(
    prompts: Sequence[Sequence[int]], answer_lens: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """:func:`allocate_microbatches` for a packed forward that stores a shared prompt once.

    Answers with the same prompt form a unit costing the prompt once plus its answers; a
    unit over ``max_tokens`` is cut, in input order, into pieces that fit (each pays for
    the prompt). Units are packed first-fit decreasing. Without shared prompts this is
    exactly ``allocate_microbatches(prompt + answer lengths)``. Returns lists of indices,
    each exactly once, a unit's answers adjacent.
    """
    max_tokens = _as_int(max_tokens, "max_tokens")
    if len(prompts) != len(answer_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(answer_lens)} answer lengths")
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    units: list[list[int]] = []
    costs: list[int] = []
    for prompt, members in by_prompt.items():
        first = len(units)  # this prompt's units start here
        for i in members:
            need = len(prompt) + _as_int(answer_lens[i], f"answer_lens[{i}]")
            if need > max_tokens:
                raise ValueError(
                    f"sequence {i} has length {need}, which exceeds the micro-batch budget max_tokens={max_tokens}"
                )
            if len(units) > first and costs[-1] + need - len(prompt) <= max_tokens:
                units[-1].append(i)
                costs[-1] += need - len(prompt)
            else:
                units.append([i])
                costs.append(need)
    return [[i for u in mb for i in units[u]] for mb in allocate_microbatches(costs, max_tokens)]


def split_fixed(n_items: int, n_groups: int) -> list[list[int]]:
    """Split ``range(n_items)`` into ``n_groups`` contiguous, non-empty groups.

    Sizes differ by at most one; the first ``n_items % n_groups`` groups are
    the larger ones. Raises ValueError if ``n_items < n_groups`` or
    ``n_groups <= 0``.
    """
    n_items = _as_int(n_items, "n_items")
    n_groups = _as_int(n_groups, "n_groups")
    if n_groups <= 0:
        raise ValueError(f"n_groups must be > 0, got {n_groups}")
    if n_items < n_groups:
        raise ValueError(f"cannot split n_items={n_items} into n_groups={n_groups} non-empty groups")
    base, extra = divmod(n_items, n_groups)
    groups: list[list[int]] = []
    start = 0
    for g in range(n_groups):
        size = base + (1 if g < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups
