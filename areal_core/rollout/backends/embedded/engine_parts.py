"""Small pieces of the engine: its stop error, future delivery, the partial-output snapshot,
the grouping of a prefill, the KV positions a request reserves."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError

from areal_core.rollout.protocol import PartialOutput, RequestsSnapshot


class EngineStopped(RuntimeError):
    """The engine was shut down."""


def deliver(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless the caller cancelled it meanwhile."""
    try:
        fut.set_result(result) if error is None else fut.set_exception(error)
    except InvalidStateError:
        pass


def requests_snapshot(version: int, seqs) -> RequestsSnapshot:
    """The output so far of every unfinished sequence in ``seqs`` (``sampling.Sequence``)."""
    return RequestsSnapshot(
        weight_version=version,
        requests=[
            PartialOutput(
                rid=s.rid,
                output_ids=list(s.out),
                output_token_logprobs=list(s.logprobs),
                output_token_versions=list(s.versions),
            )
            for s in seqs
            if s.finish is None
        ],
    )


def prefill_groups(lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """The keys of ``lengths`` (sequence -> tokens to prefill) in ascending length, cut into
    consecutive groups of one padded forward pass each: a group grows while its size times
    its longest (last) length stays within ``max_tokens``. A longer sequence goes alone.
    Ties keep the order of ``lengths``."""
    groups: list[list[int]] = [[]]
    for i in sorted(lengths, key=lengths.__getitem__):
        g = groups[-1]
        if g and (len(g) + 1) * lengths[i] > max_tokens:
            groups.append(g := [])
        g.append(i)
    return groups


def kv_reserve(s) -> int:
    """KV positions ``s`` (``sampling.Sequence``) may hold before it ends: prompt + generated so
    far + max remaining new tokens, which is prompt + max_new_tokens at every point of its life."""
    return len(s.prompt) + s.max_new
