"""A discrete-event simulator of one RL run and a planner on top of it (docs/PLANNING.md).

Pure Python and numpy: no torch, no Prefect, no GPU.

* `simulate(SimConfig) -> SimResult`: one run, synchronous or asynchronous.
* `plan(...) -> list[Alternative]`: rollout:trainer splits and eta values, best first.
* `calibrate_from(measurements) -> CostModel`: fit the cost model to measured points.
* `validation_rows()`: simulated vs published AReaL figures.
* `request.build_request` / `request.run_plan`: what `areal-flow plan` and the `plan`
  flow run.
* `measure.py` (`areal-flow calibrate`): this machine's costs, measured with the project's
  engine and trainer and fitted (the only module that imports torch); `in_situ.py`
  (`areal-flow calibrate-in-situ`): what the whole system adds to them; `local.py`
  (`areal-flow simulate RUN_DIR...`): the calibrated simulator against runs measured here.

docs/PLANNING.md describes the model, its assumptions and its validation.
"""

from areal_core.sim.calibrate import calibrate_from
from areal_core.sim.config import SimConfig, resolve
from areal_core.sim.cost import CostModel, Efficiency, build_cost_model
from areal_core.sim.engine import simulate
from areal_core.sim.hardware import GPUS, MODELS, GPUSpec, ModelSpec
from areal_core.sim.lengths import LengthDist
from areal_core.sim.planner import Alternative, plan, recommend
from areal_core.sim.result import SimResult
from areal_core.sim.validation import ValidationRow, validation_rows

__all__ = [
    "GPUS",
    "MODELS",
    "Alternative",
    "CostModel",
    "Efficiency",
    "GPUSpec",
    "LengthDist",
    "ModelSpec",
    "SimConfig",
    "SimResult",
    "ValidationRow",
    "build_cost_model",
    "calibrate_from",
    "plan",
    "recommend",
    "resolve",
    "simulate",
    "validation_rows",
]
