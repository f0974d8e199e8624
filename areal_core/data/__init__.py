"""Problem records, the synthetic chain task, and prompt encoding."""

from areal_core.data.prompting import decode_response, encode_prompt, prompt_text
from areal_core.data.records import Record, RecordError, read_records, write_records
from areal_core.data.synthetic import (
    ChainTask,
    chain_length_probs,
    check_chain,
    make_prompt,
    make_solution,
    parse_chain_answer,
    solve_chain,
)

__all__ = [
    "ChainTask",
    "Record",
    "RecordError",
    "chain_length_probs",
    "check_chain",
    "decode_response",
    "encode_prompt",
    "make_prompt",
    "make_solution",
    "parse_chain_answer",
    "prompt_text",
    "read_records",
    "solve_chain",
    "write_records",
]
