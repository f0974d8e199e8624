"""Prefect flow: train one experiment config (the long-running asynchronous run)."""

from __future__ import annotations

from prefect import flow

from tasks.flow_runs import train_run_name, user_error
from tasks.provision import apply_s3_credentials_block
from tasks.slurm import train_on_slurm
from tasks.training import train_run


@flow(name="train", log_prints=True, flow_run_name=train_run_name)
def train(
    config_path: str = "configs/quickstart.yaml",
    run_dir: str | None = None,
    max_steps: int | None = None,
    overrides: dict | None = None,
    evaluate_every: int | None = 50,
    progress: bool = False,
    cache_dir: str | None = None,
    resume: bool = False,
    s3_credentials_block: str | None = None,
    cluster: str | None = None,
) -> dict:
    """Train one experiment: warm start, asynchronous RL, held-out accuracy before and after.

    The run is named from what it runs (``quickstart-eta0-s1``: the config's name, the overrides
    that change it, the seed); its Artifacts tab holds its progress, learning curves and result.

    Args:
        config_path: The experiment's YAML config, relative to the repository (e.g.
            configs/quickstart.yaml, configs/code_quickstart.yaml) or absolute.
        run_dir: The run folder. None: a new folder runs/<run name>-<date>-<time> for each run.
            A folder that already holds checkpoints is refused unless resume is on.
        max_steps: RL steps. None: the config's trainer.max_steps (300 for the quickstart).
        overrides: Config keys to change, dotted, with their values, as JSON, e.g.
            {"trainer.eta": 0, "seed": 1, "trainer.optim.lr": 3e-5}.
        evaluate_every: Which checkpoints the evaluate deployment scores: k = every k-th version and
            the last; 0 = none; None = all of them, v0 included.
        progress: Draw progress bars in the run's process output (the worker's log).
        cache_dir: Where warm starts are cached. None: ~/.cache/areal-flow.
        resume: Continue the run in run_dir from its latest checkpoint (a retry always does).
        s3_credentials_block: A Prefect Secret block holding AWS_* variables for s3:// storage.
            None: the worker's environment.
        cluster: Set the config's cluster.kind: "slurm" runs the trainer as a Slurm job (followed
            from here, its log in this flow run's logs) and the rollout and reward pools as jobs of
            their own (docs/how-to/slurm.md); "local" or None: here.
    """
    from areal_core.experiment import ConfigError, load_config
    from areal_core.run.folder import RunFolderError, check_inputs, check_run_folder, claim_run_dir

    if s3_credentials_block:
        apply_s3_credentials_block(s3_credentials_block)
    if cluster:
        overrides = {**(overrides or {}), "cluster.kind": cluster}
    try:  # a user error ends the run with its one-line message, before anything is written
        cfg = load_config(config_path, overrides or {})
        check_inputs(cfg)
        if run_dir:
            check_run_folder(
                cfg,
                run_dir,
                resume,
                how_resume="turn on resume",
                how_new="set run_dir to None (each run then gets a folder of its own)",
            )
    except (ConfigError, RunFolderError) as e:
        return user_error(e)
    if not run_dir:
        from prefect.runtime import flow_run

        run_dir = claim_run_dir(flow_run.name or cfg.name)
        print(f"run folder: {run_dir}")
    if cluster == "slurm":
        return train_on_slurm(config_path, run_dir, max_steps, overrides)
    state = train_run(
        config_path, run_dir, max_steps, overrides, evaluate_every, progress, cache_dir, resume, return_state=True
    )
    if state.is_cancelled():  # stopped by Ctrl-C (areal-flow train), at a checkpoint resume continues from
        from prefect.states import Cancelled

        return Cancelled(message=state.message)
    return state.result()
