"""areal-flow core: the fully asynchronous RL system, importable without Prefect."""

from areal_core.numerics import pin_mkl_mode

# before anything calls MKL: its matrix products then give the same bits on any thread count
pin_mkl_mode()

__version__ = "0.1.0"
