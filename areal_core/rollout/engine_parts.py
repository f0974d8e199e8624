"""Small pieces of the engine: its stop error, future delivery, the partial-output snapshot."""

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
    return RequestsSnapshot(weight_version=version, requests=[
        PartialOutput(rid=s.rid, output_ids=list(s.out), output_token_logprobs=list(s.logprobs),
                      output_token_versions=list(s.versions))
        for s in seqs if s.finish is None
    ])
