"""The `areal-flow` command: every command a user runs, grouped as ``areal-flow --help`` lists them:
run (``commands_run.py``), evaluate (``commands_evaluate.py``), plan (``commands_plan.py``) and
operate (``commands_operate.py``).

`train` runs as a Prefect flow (reported to the server at PREFECT_API_URL when set, see
`areal-flow stack up`, else to a temporary server of the command's own, infra/command_server.py,
which a Ctrl-C in the terminal does not stop before the run has said how it ended); `train
--no-prefect` runs the same experiment in this process without importing Prefect (a node with no
Prefect server, the resume test). `eval` needs no Prefect either. Building the parser imports neither Prefect nor
torch. Config errors end in one `error: ...` line, rc 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect is imported

from flows.cli_input import UsageError
from flows.commands_evaluate import add_evaluate_commands
from flows.commands_operate import add_operate_commands
from flows.commands_plan import add_plan_commands
from flows.commands_run import add_run_commands

GROUPS = (  # (title, what adds the group's commands), in the order --help lists them
    ("run", add_run_commands),
    ("evaluate", add_evaluate_commands),
    ("plan", add_plan_commands),
    ("operate", add_operate_commands),
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("areal-flow")
    except PackageNotFoundError:
        return "(not installed)"


def _listing(groups: dict[str, list[tuple[str, str]]], width: int = 100) -> str:
    """The commands by group, each with its one-line help, as ``areal-flow --help`` shows them."""
    name_w = max(len(name) for cmds in groups.values() for name, _ in cmds) + 2
    lines = []
    for title, cmds in groups.items():
        lines.append(f"{title}:")
        for name, summary in cmds:
            text = textwrap.wrap(summary, width - 2 - name_w) or [""]
            lines.append(f"  {name.ljust(name_w)}{text[0]}")
            lines += [" " * (2 + name_w) + t for t in text[1:]]
        lines.append("")
    return "\n".join(lines).rstrip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-flow",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`areal-flow COMMAND --help` describes a command and its options.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # the commands are listed by group in the description below, not as one block
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="areal-flow")
    groups: dict[str, list[tuple[str, str]]] = {}
    for title, add in GROUPS:
        before = set(sub.choices)
        add(sub)
        groups[title] = [(n, sub.choices[n].get_default("command_help")) for n in sub.choices if n not in before]
    p.description = "Fully asynchronous RL for LLM reasoning.\n\n" + _listing(groups)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # (a time on every line: long runs and campaigns are followed, and their logs read, by the clock)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # a rollout server leaving the pool is a warning; one joining it (a requeued job back) is news as well
    logging.getLogger("areal_core.controller.recovery").setLevel(logging.INFO)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
