"""areal-flow core: the fully asynchronous RL system, importable without Prefect."""

__version__ = "0.1.0"
