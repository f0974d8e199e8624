"""Example agents for the ``openai_agent`` episode: plain ``openai`` client code, nothing of
areal-flow's.

``chain_agent`` solves the chain task (``a3b5c7=`` -> ``a3=3,b5=8,c7=15|15``) in two calls: the
running sums up to the ``|``, then, after the agent wrote the ``|`` itself, the final number::

    episode: {kind: openai_agent, path: "areal_core.episodes.examples:chain_agent"}
"""

from __future__ import annotations


def chain_agent(client: dict, prompt: str, model: str = "policy", answer_tokens: int = 8) -> str:
    try:
        from openai import OpenAI  # the agents extra; areal-flow itself does not need it
    except ImportError:
        raise ImportError(
            "this example agent is plain `openai` client code: pip install -e '.[agents]' (or pip install openai)"
        ) from None

    llm = OpenAI(**client)
    work = llm.completions.create(model=model, prompt=prompt, stop=["|"]).choices[0].text
    final = llm.completions.create(model=model, prompt=prompt + work + "|", max_tokens=answer_tokens).choices[0].text
    return f"{work}|{final}"
