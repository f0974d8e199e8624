"""How a flow run looks in the Prefect UI: its name, its artifacts' keys and links, and how a user
error ends it (one line in its logs and its state message, no traceback)."""

from __future__ import annotations

import functools
import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request

from prefect.logging import get_run_logger


def artifact_key(what: str, run_dir: str) -> str:
    """``<what>-<run folder name>`` (keys: lowercase letters, digits, dashes), no word twice in a row:
    ``train-result`` + ``runs/quickstart-eta0-s1-20261126-101500``."""
    folder = str(run_dir).rstrip("/").rsplit("/", 1)[-1]
    words = re.sub(r"[^a-z0-9]+", "-", f"{what}-{folder}".lower()).strip("-").split("-")
    kept = [w for i, w in enumerate(words) if i == 0 or w != words[i - 1]]
    return "-".join(kept)[:100].strip("-")


@functools.lru_cache(maxsize=4)
def _ui_base(ui_url: str) -> str:
    """The UI's address for links: ``.../v2`` where the server's default UI is the new one."""
    try:
        with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=5) as r:
            settings = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return ui_url  # an older server (one UI), or none reachable: links as it always took them
    v2 = settings.get("v2_base_url")
    if settings.get("default_ui") == "v2" and v2:
        parts = urllib.parse.urlsplit(ui_url)
        return f"{parts.scheme}://{parts.netloc}{v2.rstrip('/')}"
    return ui_url


def ui_link(path: str) -> str:
    """A link to ``path`` (e.g. ``artifacts/artifact/<id>``) in the UI this server opens by default;
    a bare path if no UI address is known."""
    from prefect.settings import PREFECT_UI_URL

    ui_url = (PREFECT_UI_URL.value() or "").rstrip("/")
    return f"{_ui_base(ui_url) if ui_url else ''}/{path.lstrip('/')}"


class _SaidOnce(logging.Filter):
    """Drops the engine's second report of a user error: under a worker, Prefect's engine logs the
    run's FailedRun again, with a traceback of its own code, after the run has said it in one line."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.exceptions import FailedRun

        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, FailedRun) and str(exc) == self.message)


def user_error(error: Exception):
    """End the flow run Failed with ``error``'s one-line message (what happened and what to set): in
    its logs and its state, with no traceback."""
    from prefect.states import Failed

    get_run_logger().error("%s", error)
    logging.getLogger("prefect.flow_runs").addFilter(_SaidOnce(str(error)))
    return Failed(message=str(error))


def update_markdown(artifact_id, markdown: str, description: str | None = None) -> None:
    """Replace a markdown artifact's content (the UI shows the new one; no new version is made)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    update = ArtifactUpdate(data=markdown, **({"description": description} if description else {}))
    get_client(sync_client=True).update_artifact(artifact_id=artifact_id, artifact=update)


def latest_artifacts(keys: list[str]) -> dict:
    """{key: the latest artifact with that key} for the keys that have one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    if not keys:
        return {}
    found = get_client(sync_client=True).read_latest_artifacts(
        artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=keys))
    )
    return {a.key: a for a in found}


def train_run_name() -> str:
    """The ``train`` flow run's name, from its parameters: ``<config name>[-<overrides that differ>]-s<seed>``."""
    from prefect.runtime import flow_run

    from areal_core.experiment import ConfigError
    from areal_core.run.folder import describe_run

    p = flow_run.parameters
    try:
        return describe_run(p["config_path"], p.get("overrides"), p.get("max_steps"))
    except ConfigError:  # the flow itself then ends with the config's error
        return "train-" + str(p["config_path"]).rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _params() -> dict:
    from prefect.runtime import flow_run

    return flow_run.parameters


def _stem(path) -> str:
    paths = [path] if isinstance(path, str) else list(path or [])
    return "+".join(str(p).rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0] for p in paths) or "config"


def _axes(p: dict) -> str:
    """The grid a sweep or campaign runs: ``-eta0,4-decoupled,naive-lr1e-4,3e-5``."""
    out = ""
    if p.get("eta"):
        out += "-eta" + ",".join(str(v) for v in p["eta"])
    if p.get("objective"):
        out += "-" + ",".join(p["objective"])
    for key, values in (p.get("grid") or {}).items():
        out += f"-{key.rsplit('.', 1)[-1]}" + ",".join(str(v) for v in values)
    return out + (f"-steps{p['max_steps']}" if p.get("max_steps") else "")


def sweep_run_name() -> str:
    return f"sweep-{_stem(_params().get('config_path'))}{_axes(_params())}"


def campaign_run_name() -> str:
    return f"campaign-{_stem(_params().get('config_path'))}{_axes(_params())}"


def report_run_name() -> str:
    return f"report-{str(_params().get('out_dir', '')).rstrip('/').rsplit('/', 1)[-1]}"


def replay_run_name() -> str:
    return f"replay-{str(_params().get('out_dir', '')).rstrip('/').rsplit('/', 1)[-1]}"


def provision_run_name() -> str:
    return f"provision-{_stem(_params().get('config_path'))}"


def prepare_data_run_name() -> str:
    return f"prepare-data-{_params().get('source', 'synthetic')}"


def plan_run_name() -> str:
    p = _params()
    return f"plan-{p.get('model', '7B')}-{p.get('n_gpus', 64)}x{p.get('gpu', 'H800')}"


def serve_run_name() -> str:
    return f"rollout-servers-{_stem(_params().get('config_path'))}"
