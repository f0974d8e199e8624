"""A run: its setup from the config, the step loop, its folder, checkpoints, schedule, ledger, summary and replay."""
