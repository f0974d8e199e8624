"""Evaluation: held-out accuracy for training runs, and benchmark evaluation of checkpoints."""

from areal_core.eval.passk import maj_at_k, pass_at_k

__all__ = ["maj_at_k", "pass_at_k"]
