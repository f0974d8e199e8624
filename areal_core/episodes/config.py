"""``episode:`` in an experiment config: which episode rolls out a prompt group (a tagged union)."""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal

from pydantic import Field

from areal_core.configbase import Section


class SingleTurnConfig(Section):
    """The policy answers once and its answer is graded (the default)."""

    kind: Literal["single_turn"] = "single_turn"


class RetryConfig(Section):
    """A wrong answer gets ``feedback`` (``{reason}``: the grader's, ``{parsed}``: the answer it read)
    and another turn, up to ``max_turns`` answers; a right answer at turn k earns
    ``discount**(k-1)`` of the way from reward_wrong to reward_correct."""

    kind: Literal["retry"] = "retry"
    max_turns: int = Field(2, ge=1)  # tries at most, the first included (1: no retry)
    discount: float = Field(1.0, gt=0.0, le=1.0)  # a right answer at turn k earns discount**(k-1); 1: no discount
    feedback: str = "\nwrong ({reason}); again: "  # the message after a wrong answer ({reason}, {parsed} filled in)
    max_new_tokens_per_turn: int | None = Field(None, ge=1)  # None: rollout.sampling.max_new_tokens


class ToolConfig(Section):
    """The policy may call Python between ``open_tag`` and ``close_tag``; the call runs in the sandbox
    (at most ``timeout_s`` seconds, output cut to ``max_output_chars``) and its output comes back as
    ``result_template`` (environment text, never trained), up to ``max_calls`` calls per answer; the
    whole answer is graded once (areal_core/episodes/tool.py). The defaults match the chain task's
    ``format: tool`` demonstrations."""

    kind: Literal["tool"] = "tool"
    max_calls: int = Field(1, ge=0)  # tool calls run per answer at most; 0: none (a call is then plain text)
    timeout_s: float = Field(2.0, gt=0.0, le=60.0)  # wall-clock seconds one call may run
    max_output_chars: int = Field(64, ge=1)  # a call's output is cut to this many characters
    max_new_tokens_per_turn: int | None = Field(None, ge=1)  # None: rollout.sampling.max_new_tokens
    open_tag: str = Field("<py>", min_length=1)  # the text that opens a call
    close_tag: str = Field("</py>", min_length=1)  # the text that closes a call and ends the turn
    result_template: str = Field("<out>{output}</out>", pattern=r"\{output\}")  # how an output is sent back ({output})
    stop_token_ids: list[int] | None = None  # None: the last token of close_tag
    memory_mb: int = Field(512, ge=64)  # address space of a call's process
    max_parallel: int = Field(2, ge=1)  # sandbox runs at a time


class ImportedConfig(Section):
    """``path: "package.module:factory"``: ``factory(**options)`` returns an episode."""

    kind: Literal["import"] = "import"
    path: str = Field(pattern=r"^[\w.]+:\w+$")  # "package.module:factory": factory(**options) returns the episode
    options: dict[str, Any] = {}  # keyword arguments of the factory


class OpenAIAgentConfig(Section):
    """An agent written against the ``openai`` client, trained as it is: ``path: "module:function"``
    is called as ``function(client, prompt, **options)`` for each answer (``openai.OpenAI(**client)``
    reaches a local OpenAI-compatible endpoint; every model call is one policy turn, what the agent
    adds between calls is environment text) and returns the answer that is graded
    (areal_core/episodes/openai_agent.py)."""

    kind: Literal["openai_agent"] = "openai_agent"
    path: str = Field(pattern=r"^[\w.]+:\w+$")  # "module:function": the agent, called once per answer
    options: dict[str, Any] = {}  # keyword arguments the agent function is called with, after client and prompt
    max_calls: int = Field(8, ge=1)  # model calls per answer; more are refused (400)
    max_new_tokens_per_call: int | None = Field(None, ge=1)  # caps a call's max_tokens (neither: rollout's)
    chat_template: str | None = None  # Jinja text for /v1/chat/completions (None: the tokenizer's, else plain)
    tokenizer: str | None = None  # a Hugging Face tokenizer (folder or name) whose chat template renders chats
    timeout_s: float = Field(600.0, gt=0.0)  # per answer
    on_agent_error: Literal["raise", "wrong"] = "raise"  # an agent that raises: fail the run, or grade it wrong
    max_concurrent: int = Field(64, ge=1)  # threads for sync agents


EpisodeConfig = Annotated[
    SingleTurnConfig | RetryConfig | ToolConfig | OpenAIAgentConfig | ImportedConfig, Field(discriminator="kind")
]


def make_episode(cfg):
    from areal_core.episodes.base import SingleTurn
    from areal_core.episodes.retry import RetryWithFeedback

    if cfg.kind == "single_turn":
        return SingleTurn()
    if cfg.kind == "retry":
        return RetryWithFeedback(cfg.max_turns, cfg.discount, cfg.feedback, cfg.max_new_tokens_per_turn)
    if cfg.kind == "tool":
        from areal_core.episodes.tool import ToolUse

        return ToolUse(**cfg.model_dump(exclude={"kind"}))
    if cfg.kind == "openai_agent":
        from areal_core.episodes.openai_agent import OpenAIAgent

        return OpenAIAgent(**cfg.model_dump(exclude={"kind"}))
    module, name = cfg.path.split(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"episode.path {cfg.path!r}: {e}") from None
    return factory(**cfg.options)
