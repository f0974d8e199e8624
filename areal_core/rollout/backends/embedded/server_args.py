"""The embedded server's command line: ``areal-flow rollout-server`` and the process a run's launcher
starts (``python -m areal_core.rollout.backends.embedded.server``) take the same arguments. Building
``areal-flow``'s parser with them loads no engine, model or torch."""

from __future__ import annotations

import argparse

from areal_core.rollout.auth import API_KEY_ENV


def _engine_config(text: str):
    import pydantic

    from areal_core.rollout.config import EngineConfig

    try:
        return EngineConfig.model_validate_json(text)
    except pydantic.ValidationError as e:
        raise argparse.ArgumentTypeError(
            "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        ) from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", required=True, help="Hugging Face model folder or fsspec URL")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, required=True, help="the port to listen on (0: a free one)")
    ap.add_argument(
        "--host-towards",
        metavar="ADDRESS",
        help="listen on this host's address on the route to ADDRESS (e.g. the trainer's), instead of --host: "
        "for a job that does not know which of its node's addresses the run reaches",
    )
    ap.add_argument(
        "--announce",
        metavar="LIST",
        help="once serving, add this server's URL to LIST (a run's rollout.join_from: the run takes it in); "
        "taken out again when the server stops",
    )
    ap.add_argument("--weight-version", type=int, default=0, help="the version the loaded weights are (default 0)")
    ap.add_argument(
        "--engine-config",
        type=_engine_config,
        default="{}",
        metavar="JSON",
        help="the engine's settings as JSON (EngineConfig in areal_core/rollout/config.py; default: its defaults)",
    )
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    ap.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help=f"serve without a key when {API_KEY_ENV} is not set (any local process can then drive it)",
    )
    ap.add_argument("--log-level", default="info", help="the server's log level (default info)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m areal_core.rollout.backends.embedded.server",
        description="The embedded rollout server: the engine behind a subset of SGLang's HTTP API.",
    )
    add_arguments(ap)
    return ap.parse_args(argv)
