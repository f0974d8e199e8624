"""Where a run's pools run: this machine, or jobs of a cluster scheduler (Slurm)."""
