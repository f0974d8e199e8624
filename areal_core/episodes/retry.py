"""Retry with feedback: a wrong answer gets the grader's verdict as the next message and another
try, up to ``max_turns`` answers; the reward is the final answer's, discounted per extra turn.
An answer whose trajectory has no room left for the feedback and a token more (``fits``) gets no
further try: its last verdict stands."""

from __future__ import annotations

from dataclasses import replace

from areal_core.episodes.base import EpisodeContext, append_environment, fits, last_turn_text
from areal_core.reward.result import RewardResult
from areal_core.types import Trajectory


class RetryWithFeedback:
    def __init__(
        self,
        max_turns: int = 2,
        discount: float = 1.0,
        feedback: str = "\nwrong ({reason}); again: ",
        max_new_tokens_per_turn: int | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        self.max_turns, self.discount, self.feedback = max_turns, discount, feedback
        self.max_new = max_new_tokens_per_turn

    def message(self, result: RewardResult) -> str:
        return self.feedback.format(reason=result.reason or "wrong", parsed=result.parsed or "")

    async def run(self, group: list[Trajectory], ctx: EpisodeContext) -> list[RewardResult]:
        await ctx.generate(group, self.max_new)
        results = await ctx.grade(group, [last_turn_text(t, ctx) for t in group])
        turns = [1] * len(group)
        for _ in range(1, self.max_turns):
            wrong = []
            for i in (i for i, r in enumerate(results) if not r.correct):
                feedback = ctx.encode(self.message(results[i]))
                if fits(ctx, group[i], feedback):
                    append_environment(group[i], feedback, ctx.version)
                    turns[i] += 1
                    wrong.append(i)
            if not wrong:
                break
            retry = [group[i] for i in wrong]
            await ctx.generate(retry, self.max_new)
            for i, r in zip(wrong, await ctx.grade(retry, [last_turn_text(t, ctx) for t in retry])):
                results[i] = r
        for t, n in zip(group, turns):
            t.reward_info = {**t.reward_info, "turns": n}
        if self.discount == 1.0:
            return results
        # the final answer's credit (1 if right, or its partial score), times discount**(turns - 1)
        return [
            replace(r, score=(r.score if r.score is not None else float(r.correct)) * self.discount ** (n - 1))
            for r, n in zip(results, turns)
        ]
