"""Every `areal-flow` command line the README and docs/ show parses with the real CLI parser
(synopsis placeholders such as CONFIG or DIR filled in), so a renamed or removed option breaks a
test, not a user's first try. Running them is what the other CLI tests do."""

import re
import shlex
from pathlib import Path

import pytest

from flows.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # the tutorials and how-to pages too
PLACEHOLDERS = {
    "CONFIG": "configs/quickstart.yaml",
    "DIR": "runs/x",
    "N": "3",
    "K": "4",
    "S": "0",
    "CHECKPOINT_OR_MODEL": "runs/x/checkpoints/v1",
    "RUN/checkpoints/vN": "runs/x/checkpoints/v1",
    "NAME": "gsm8k",
    "NAME2": "math500",
    "VALUE": "1",
    "T": "0.7",
    "P": "0.9",
    "M": "64",
    "DASK_ADDRESS": "tcp://127.0.0.1:8786",
    "RUN": "runs/x",
}


def command_lines(text: str) -> list[str]:
    """`areal-flow ...` lines of fenced code blocks (continuation lines joined), and inline code
    that names a file (`areal-flow train configs/x.yaml`; a bare `areal-flow train --resume` in prose
    names a feature); comments dropped."""
    found = []
    in_block = False
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        cands = (
            [line]
            if in_block
            else [c for c in re.findall(r"`([^`]*areal-flow [^`]*)`", line) if "/" in c and " ... " not in c]
        )
        for cand in cands:
            c = re.sub(r"^\s*(\.venv/bin/)?(?=areal-flow )", "", cand.split(" #")[0]).strip().rstrip("&").strip()
            if c.startswith("areal-flow "):
                found.append(c)
    return found


def expand(cmd: str) -> list[list[str]]:
    cmd = re.sub(r"\[([^\]]*)\]", r"\1", cmd).replace("...", " ")
    cmd = re.sub(r"--(eta|objective) \s*(?=--|$)", r"--\1 0 ", cmd)  # `--eta ... --objective ...`
    m = re.match(r"(areal-flow \w+) (\w+(?: \| \w+)+)$", cmd.strip())
    variants = [f"{m.group(1)} {alt}" for alt in m.group(2).split(" | ")] if m else [cmd]
    out = []
    for v in variants:
        args = shlex.split(v)[1:]
        out.append([PLACEHOLDERS.get(a, a) for a in args])
    return out


CASES = [
    (doc.relative_to(REPO).as_posix(), argv)
    for doc in DOCS
    for cmd in command_lines(doc.read_text())
    for argv in expand(cmd)
]


def test_the_docs_show_commands_of_every_kind():
    kinds = {argv[0] for _, argv in CASES}
    assert {"train", "eval", "sweep", "campaign", "stack", "plan"} <= kinds, kinds


@pytest.mark.parametrize("doc,argv", CASES, ids=[f"{d}:{' '.join(a)[:60]}" for d, a in CASES])
def test_documented_command_parses(doc, argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:  # --help exits 0
        if e.code != 0:
            pytest.fail(f"{doc}: `areal-flow {' '.join(argv)}` does not parse (exit {e.code})")
