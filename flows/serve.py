"""Prefect flow: keep a pool of rollout servers up on a work pool's machine, for training runs
elsewhere to connect to (docs/OPERATIONS.md, "Rollout servers on a cluster").

While the servers are up, their URLs are in the Prefect Variable ``rollout-urls-<config>-<host>``
and in a markdown artifact with the config lines that use them; the Variable is removed when they
stop (``hold_s`` elapsed, or the flow run cancelled from the UI)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.variables import Variable

from areal_core.controller.elastic import announce
from areal_core.experiment import load_config
from areal_core.ops.serve import serve_rollout
from tasks.flow_runs import serve_run_name


def urls_variable(config_name: str, host: str | None = None) -> str:
    """The Prefect Variable holding a pool's URLs (names: lowercase letters, digits, dashes)."""
    raw = f"rollout-urls-{config_name}-{host or socket.gethostname()}"
    return re.sub(r"[^a-z0-9_-]+", "-", raw.lower()).strip("-")[:255]


@flow(name="rollout-servers", log_prints=True, flow_run_name=serve_run_name)
def rollout_servers(
    model_path: str,
    config_path: str = "configs/quickstart.yaml",
    overrides: dict | None = None,
    hold_s: float | None = 3600.0,
    check_every_s: float = 30.0,
    log_dir: str = "runs/rollout-servers",
    join_run: str | None = None,
    api_key_file: str | None = None,
) -> dict:
    """Keep a pool of rollout servers up for training runs elsewhere to connect to.

    Args:
        model_path: What to serve: a checkpoint version folder or a Hugging Face model folder on this machine.
        config_path: The YAML config whose rollout section (backend, n_servers, ...) the pool follows.
        overrides: Config keys to change, dotted, as JSON, e.g. {"rollout.n_servers": 4}.
        hold_s: Seconds to keep the servers up. None: until the flow run is cancelled.
        check_every_s: Seconds between health checks.
        log_dir: Where the servers' logs go.
        join_run: A running training run's rollout.join_from file (path or s3:// URL): the servers are
            added to it once up, so they join that run, and taken out when they stop.
        api_key_file: A file holding the API key the servers require (with join_run: the running run's
            rollout.backend.api_key_file). None: a key made for the pool.
    """
    cfg = load_config(config_path, overrides)
    name = urls_variable(cfg.name)
    logger = get_run_logger()
    announced: list[str] = []  # in join_run's list while up

    def publish(urls: list[str]) -> None:
        Variable.set(name, urls, overwrite=True)
        if join_run:
            announce(join_run, urls)
            announced[:] = urls
            logger.info("%d server(s) announced to the run through %s", len(urls), join_run)
        kind = "sglang" if cfg.rollout.backend.kind == "sglang" else "external"
        create_markdown_artifact(
            "\n".join(
                [
                    f"### {len(urls)} rollout server(s) of `{model_path}`",
                    "",
                    *(f"- {u}" for u in urls),
                    "",
                    f"Prefect Variable `{name}`. A training run on another machine connects with:",
                    "",
                    "```yaml",
                    "rollout:",
                    f"  backend: {{kind: {kind}, urls: [{', '.join(urls)}]}}",
                    "```",
                ]
            ),
            key=name[:100],
            description=f"rollout servers of {cfg.name}",
        )

    def report(ok: list[bool]) -> None:
        if not all(ok):
            logger.warning("%d of %d rollout servers failed their health check", ok.count(False), len(ok))

    key = Path(api_key_file).read_text().strip() if api_key_file else None
    try:
        return serve_rollout(
            cfg,
            model_path,
            log_dir=log_dir,
            hold_s=hold_s,
            check_every_s=check_every_s,
            on_up=publish,
            on_check=report,
            api_key=key,
        )
    finally:
        Variable.unset(name)
        if announced:
            announce(join_run, announced, present=False)
