"""Prefect flow: keep a pool of rollout servers up on a work pool's machine, for training runs
elsewhere to connect to (docs/OPERATIONS.md, "Rollout servers on a cluster").

While the servers are up, their URLs are in the Prefect Variable ``rollout-urls-<config>-<host>``
and in a markdown artifact with the config lines that use them; the Variable is removed when they
stop (``hold_s`` elapsed, or the flow run cancelled from the UI)."""

from __future__ import annotations

import re
import socket

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.variables import Variable

from areal_core.experiment import load_config
from areal_core.serve import serve_rollout
from tasks.flow_runs import serve_run_name


def urls_variable(config_name: str, host: str | None = None) -> str:
    """The Prefect Variable holding a pool's URLs (names: lowercase letters, digits, dashes)."""
    raw = f"rollout-urls-{config_name}-{host or socket.gethostname()}"
    return re.sub(r"[^a-z0-9_-]+", "-", raw.lower()).strip("-")[:255]


@flow(name="rollout-servers", log_prints=True, flow_run_name=serve_run_name)
def rollout_servers(model_path: str, config_path: str = "configs/quickstart.yaml", overrides: dict | None = None,
                    hold_s: float | None = 3600.0, check_every_s: float = 30.0,
                    log_dir: str = "runs/rollout-servers") -> dict:
    """Keep a pool of rollout servers up for training runs elsewhere to connect to.

    Args:
        model_path: What to serve: a checkpoint version folder or a Hugging Face model folder on this machine.
        config_path: The YAML config whose rollout section (backend, n_servers, ...) the pool follows.
        overrides: Config keys to change, dotted, as JSON, e.g. {"rollout.n_servers": 4}.
        hold_s: Seconds to keep the servers up. None: until the flow run is cancelled.
        check_every_s: Seconds between health checks.
        log_dir: Where the servers' logs go.
    """
    cfg = load_config(config_path, overrides)
    name = urls_variable(cfg.name)
    logger = get_run_logger()

    def publish(urls: list[str]) -> None:
        Variable.set(name, urls, overwrite=True)
        kind = "sglang" if cfg.rollout.backend.kind == "sglang" else "external"
        create_markdown_artifact(
            "\n".join([f"### {len(urls)} rollout server(s) of `{model_path}`", "", *(f"- {u}" for u in urls), "",
                       f"Prefect Variable `{name}`. A training run on another machine connects with:", "",
                       "```yaml", "rollout:", f"  backend: {{kind: {kind}, urls: [{', '.join(urls)}]}}", "```"]),
            key=name[:100], description=f"rollout servers of {cfg.name}")

    def report(ok: list[bool]) -> None:
        if not all(ok):
            logger.warning("%d of %d rollout servers failed their health check", ok.count(False), len(ok))

    try:
        return serve_rollout(cfg, model_path, log_dir=log_dir, hold_s=hold_s, check_every_s=check_every_s,
                             on_up=publish, on_check=report)
    finally:
        Variable.unset(name)
