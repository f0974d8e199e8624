"""The `areal-flow` commands that operate runs and their machines: ``runs`` (the run folders and
their state), ``export`` (a checkpoint as a plain model folder), ``serve`` (a pool of rollout servers),
``rollout-server`` (one embedded server, started by hand) and ``stack`` (the local Prefect server)."""

from __future__ import annotations

import json

from flows.cli_input import UsageError, add_command, add_set, config_from, overrides_from


def cmd_runs(args) -> int:
    from areal_core.run.folder import runs_root
    from areal_core.run.listing import list_runs

    root = args.root or runs_root()
    try:
        entries = list_runs(root)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if not entries:
        print(f"no runs under {root}")
        return 0
    rows = [("folder", "config", "state", "steps", "held-out before -> after")]
    rows += [(e.folder, e.name, e.state, e.steps, e.accuracy) for e in entries]
    if any(e.jobs for e in entries):  # runs on Slurm (cluster: slurm): their jobs' ids, by role
        rows = [(*r, j) for r, j in zip(rows, ["slurm jobs", *(e.jobs for e in entries)])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_export(args) -> int:
    from areal_core.trainer.export import ExportError, export_checkpoint, export_peft

    try:
        print((export_peft if args.peft else export_checkpoint)(args.source, args.out))
    except ExportError as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_serve(args) -> int:
    overrides = overrides_from(args.set)
    cfg = config_from(args.config, overrides)
    hold = None if args.hold_s <= 0 else args.hold_s
    if args.no_prefect:
        from areal_core.ops.serve import serve_rollout

        def up(urls: list[str]) -> None:
            print("rollout servers up: " + " ".join(urls), flush=True)

        try:
            out = serve_rollout(cfg, args.model, log_dir=args.log_dir, hold_s=hold, on_up=up)
        except KeyboardInterrupt:
            print("stopped")
            return 130
    else:
        from flows.serve import rollout_servers
        from infra.command_server import prefect_api

        with prefect_api():
            out = rollout_servers(
                args.model, args.config, overrides=overrides or None, hold_s=hold, log_dir=args.log_dir
            )
    print(json.dumps(out))
    return 0


def cmd_rollout_server(args) -> int:
    from areal_core.rollout.backends.embedded.server import serve

    serve(args)
    return 0


def cmd_stack(args) -> int:
    from infra import stack

    return stack.main([args.action] + (["--port", str(args.port)] if args.port else []))


def _runs_parser(sub) -> None:
    n = add_command(
        sub,
        "runs",
        "list the run folders and their state (finished, or unfinished: running, "
        "or stopped at its last checkpoint, which --resume continues from)",
        cmd_runs,
    )
    n.add_argument("root", nargs="?", help="where to look (default: $AREAL_RUNS_DIR or runs/)")


def _export_parser(sub) -> None:
    x = add_command(
        sub, "export", "write a checkpoint as a plain HF model folder (full weights; LoRA merged)", cmd_export
    )
    x.add_argument(
        "source",
        metavar="SOURCE",
        help="a checkpoint version (RUN/checkpoints/vN, folder or URL) or a run folder (its latest)",
    )
    x.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    x.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint as its adapters in PEFT's format: DIR/base (the base model) and DIR/adapter "
        "(PeftModel.from_pretrained loads it), instead of the merged weights",
    )


def _serve_parser(sub) -> None:
    s = add_command(
        sub, "serve", "keep a pool of rollout servers up for runs elsewhere (the rollout-servers flow)", cmd_serve
    )
    s.add_argument("model", help="a checkpoint version folder (RUN/checkpoints/vN) or an HF model folder")
    s.add_argument(
        "--config", default="configs/quickstart.yaml", help="the config whose rollout section the pool follows"
    )
    add_set(s)
    s.add_argument("--hold-s", type=float, default=0.0, help="seconds to keep them up (default 0: until Ctrl-C)")
    s.add_argument("--log-dir", default="runs/rollout-servers", help="where the servers' logs and API key go")
    s.add_argument("--no-prefect", action="store_true", help="serve without a Prefect flow run")


def _rollout_server_parser(sub) -> None:
    from areal_core.rollout.backends.embedded.server_args import API_KEY_ENV, add_arguments

    r = add_command(
        sub,
        "rollout-server",
        "one embedded rollout server in this process, for runs on other hosts",
        cmd_rollout_server,
        description=f"One embedded rollout server (SGLang's HTTP API subset, docs/ARCHITECTURE.md). It "
        f"takes its API key from {API_KEY_ENV} in its environment, never from the command line.",
    )
    add_arguments(r)


def _stack_parser(sub) -> None:
    k = add_command(sub, "stack", "the local Prefect server + worker with the deployments", cmd_stack)
    k.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start the server, a worker and the deployments; down: stop them; status: show them",
    )
    k.add_argument("--port", type=int, help="server port for `up` (default 4200, or a free one if taken)")


def add_operate_commands(sub) -> None:
    """operate: runs, export, serve, rollout-server, stack."""
    for add in (_runs_parser, _export_parser, _serve_parser, _rollout_server_parser, _stack_parser):
        add(sub)
