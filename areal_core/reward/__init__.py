"""Rewards: graders (math, code, the synthetic chain task) and the Dask reward service."""

from areal_core.reward.code import CodeResult, extract_code, grade_code
from areal_core.reward.math import extract_final_answer, grade_math, grade_math_result
from areal_core.reward.result import RewardResult

__all__ = [
    "CodeResult",
    "RewardResult",
    "extract_code",
    "extract_final_answer",
    "grade_code",
    "grade_math",
    "grade_math_result",
]
