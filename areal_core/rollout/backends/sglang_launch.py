"""How SGLang servers are started and found: the launch command, the file that carries the API key,
and the check that configured servers answer."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from areal_core.rollout import auth
from areal_core.rollout.client import RolloutServerError, check_health_sync

if TYPE_CHECKING:
    from areal_core.rollout.backends.sglang import SGLangConfig


def sglang_launch_command(
    cfg: SGLangConfig, model_path: str, port: int, weight_version: int = 0, config_file: str | None = None
) -> list[str]:
    """``config_file``: SGLang's ``--config`` YAML (``write_server_config``: the API key)."""
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(cfg.tp_size)]
    cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--host", cfg.host, "--port", str(port)]
    cmd += ["--weight-version", str(weight_version), *(["--config", config_file] if config_file else [])]
    return cmd + list(cfg.extra_args)


def write_server_config(folder: str, api_key: str) -> str:
    """The YAML file given to ``sglang.launch_server --config``: ``api-key`` (SGLang's ``--api-key``),
    in ``folder`` with mode 0600, so the key is in no process's argv."""
    return auth.write_private_file(os.path.join(folder, "sglang-server.yaml"), f"api-key: {json.dumps(api_key)}")


def check_reachable(urls: Sequence[str], timeout_s: float) -> None:
    """Raise RolloutServerError (server_down) naming each configured URL whose /health does not
    answer 200 within ``timeout_s``."""
    deadline, dead = time.monotonic() + timeout_s, list(urls)
    while dead:
        dead = [u for u in dead if not check_health_sync(u.rstrip("/"), timeout_s=2.0)]
        if dead and time.monotonic() > deadline:
            raise RolloutServerError(
                dead[0],
                None,
                "configured SGLang server unreachable: tried GET "
                + ", ".join(f"{u.rstrip('/')}/health" for u in dead)
                + f" for {timeout_s:.0f}s without a 200 answer",
            )
        if dead:
            time.sleep(0.2)
