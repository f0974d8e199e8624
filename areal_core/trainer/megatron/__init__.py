"""A megatron-core trainer backend (needs the ``megatron`` extra: ``pip install -e ".[megatron]"``).

- ``shims``: the CPU replacements for megatron's CUDA assumptions (listed in shims.py);
- ``mapping``: HF Llama / Qwen2 / Qwen3 config -> GPTModel, and the weights both ways (tensor-parallel);
- ``parallel``: gloo process groups (``torchrun``), rank 0's command broadcast;
- ``engine``: the per-rank collective work (a PPO step, gathering weights, state);
- ``trainer``: ``MegatronTrainer``, the torch ``Trainer``'s surface, on rank 0;
- ``follower``: ``follow(tp)``, what the other ranks run.

Nothing here is imported by ``areal_core`` unless this backend is chosen.
"""

import warnings

# megatron-core's import- and build-time advice for CUDA machines (Apex, CUDA graphs, CUDA stream
# connections) means nothing on the CPU path and would fill every run's console
for _message in (
    "Apex is not installed",
    "full scope is deprecated",
    "When using async grad allreduce it is recommended",
):
    warnings.filterwarnings("ignore", message=_message)
