"""Send a run to a deployment of the Prefect server at PREFECT_API_URL and follow it until it ends.

``areal-flow train --deployment`` uses it: the run then shows under the deployment's runs in the UI
(a flow run started from the command line in its own process does not), and a worker runs it.
"""

from __future__ import annotations

import time


class DeploymentError(RuntimeError):
    """The run could not be sent (no server, no such deployment)."""


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeploymentError(
            "--deployment sends the run to a Prefect server: set PREFECT_API_URL "
            "(`areal-flow stack up` prints the line to use)"
        )
    return url


def submit_and_follow(deployment: str, parameters: dict, poll_s: float = 3.0, log=print) -> int:
    """Create a flow run of ``deployment`` with ``parameters`` (None values left to the deployment's
    defaults) and print its state changes until it ends: 0 if it completed, 1 if not. Ctrl-C stops
    following (status 130); the run goes on on its worker."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from tasks.flow_runs import ui_link

    api = _api_url()
    params = {k: v for k, v in parameters.items() if v is not None}
    client = get_client(sync_client=True)
    try:
        dep = client.read_deployment_by_name(deployment)
    except ObjectNotFound:
        raise DeploymentError(
            f"no deployment {deployment} on {api}: `areal-flow stack up` deploys prefect.yaml"
        ) from None
    run = client.create_flow_run_from_deployment(dep.id, parameters=params)
    url = ui_link(f"runs/flow-run/{run.id}")
    log(f"sent to the {deployment} deployment: {url}")
    seen = None
    try:
        while True:
            run = client.read_flow_run(run.id)
            now = (run.name, run.state.name if run.state else None)
            if now != seen:
                log(
                    f"flow run {run.name}: {now[1]}"
                    + (f" ({run.state.message})" if run.state and run.state.message and run.state.is_final() else "")
                )
                seen = now
            if run.state is not None and run.state.is_final():
                return 0 if run.state.is_completed() else 1
            time.sleep(poll_s)
    except KeyboardInterrupt:
        log(f"stopped following; the run goes on on the worker: {url}")
        return 130
