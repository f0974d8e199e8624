"""prefect.yaml, read as a file: the deployments the stack tests expect, each pointing at a flow that exists."""

import ast
from pathlib import Path

import yaml

from tests.prefect_api import DEPLOYMENTS

ROOT = Path(__file__).resolve().parents[2]


def _deployments() -> list[dict]:
    return yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


def test_prefect_yaml_declares_the_expected_deployments():
    names = [d["name"] for d in _deployments()]
    assert len(names) == len(set(names)), names
    assert set(names) == DEPLOYMENTS


def test_every_entrypoint_names_a_flow_function():
    for dep in _deployments():
        path, func = dep["entrypoint"].split(":")
        tree = ast.parse((ROOT / path).read_text())
        flows = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any("flow" in ast.unparse(d) for d in node.decorator_list)
        }
        assert func in flows, f"{dep['name']}: {dep['entrypoint']} is not a @flow function"
