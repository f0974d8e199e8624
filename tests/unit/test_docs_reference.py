"""The docs' reference pages (docs/reference/) are what the code gives: every config key of the
config models, every command of the parser, every deployment of prefect.yaml."""

import re

import pytest
from pydantic import BaseModel

from infra.docs_reference import PAGES, _models_in, pages


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return pages()


@pytest.mark.parametrize("name", ["config.md", "cli.md", "deployments.md"])
def test_each_committed_page_is_what_the_code_gives(generated, name):
    assert (PAGES / name).read_text() == generated[name], (
        f"docs/reference/{name} is stale: python -m infra.docs_reference writes it"
    )


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key of ``model`` and its sections, walked here independently of the page's generator."""
    out = set()
    for name, field in model.model_fields.items():
        out.add(prefix + name)
        for sub in _models_in(field.annotation):
            out |= _keys(sub, f"{prefix}{name}.")
    return out


def test_the_config_reference_lists_every_field_and_says_what_each_does(generated):
    from areal_core.experiment import ExperimentConfig

    rows = []  # (key, what it does): the table's first and last cells (a cell's own "|" is escaped)
    for line in generated["config.md"].splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append((cells[0].strip("`"), cells[-1]))
    listed = {key.split(" (kind:")[0] for key, _ in rows}
    assert listed == _keys(ExperimentConfig)
    assert len(listed) > 150
    unexplained = [key for key, help_ in rows if not help_.strip()]
    assert not unexplained, f"config keys without a comment in the code: {unexplained}"


def test_the_command_reference_lists_every_subcommand(generated):
    from flows.cli import build_parser
    from infra.docs_reference import _subparsers

    for name in _subparsers(build_parser()):
        assert f"## `areal-flow {name}`" in generated["cli.md"]


def test_the_deployment_reference_lists_every_deployment(generated):
    import yaml

    from infra.docs_reference import ROOT

    for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]:
        assert f"## `{d['name']}`" in generated["deployments.md"]
