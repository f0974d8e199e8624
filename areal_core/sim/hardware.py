"""Published per-device and per-model figures the cost model is built from.

GPU figures are the vendor datasheets' numbers (bf16 Tensor Core peak *without*
sparsity: the datasheets print the 2:4-sparsity figure, twice the dense one):

* NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 TFLOPS with sparsity
  (989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
* NVIDIA H800 (SXM) datasheet: the H100 SXM's compute and memory (BF16 1,979 TFLOPS
  with sparsity, 80 GB HBM3, 3.35 TB/s), NVLink cut to 400 GB/s.
* NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 312 TFLOPS dense (624
  with sparsity), 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s.
* NVIDIA H200 datasheet, H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s.

Model figures are the Qwen2.5 configs (config.json: hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads; head_dim = hidden / heads = 128) and the
model cards' parameter counts (1.54B, 7.61B, 32.5B). DeepSeek-R1-Distill-Qwen-1.5B,
-7B and -32B, the models of the AReaL paper, share these shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator.

    Attributes:
        name: label.
        peak_flops: dense bf16 Tensor Core peak, FLOP/s.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        memory_bytes: device memory, bytes.
        nvlink_bandwidth: intra-node GPU-to-GPU bandwidth, bytes/s (used for the
            weight-update default when no measured figure is given).
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    nvlink_bandwidth: float


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer (Qwen2/Llama family, grouped-query attention).

    Attributes:
        name: label.
        params: total parameters.
        layers: transformer blocks.
        hidden: model width.
        heads: query heads.
        kv_heads: key/value heads.
        head_dim: width of one head.
        bytes_per_param: serving and trained-copy dtype size (bf16: 2).
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers, in the serving dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attn_flops_per_token_pair(self) -> float:
        """FLOPs of one query token attending to one key token (QK^T and AV), all layers."""
        return 4 * self.layers * self.heads * self.head_dim


TB = 1e12
GB = 1e9

GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec(
        "H100", peak_flops=989e12, hbm_bandwidth=3.35 * TB, memory_bytes=80 * GB, nvlink_bandwidth=900 * GB
    ),
    "H800": GPUSpec(
        "H800", peak_flops=989e12, hbm_bandwidth=3.35 * TB, memory_bytes=80 * GB, nvlink_bandwidth=400 * GB
    ),
    "A100": GPUSpec(
        "A100", peak_flops=312e12, hbm_bandwidth=2.039 * TB, memory_bytes=80 * GB, nvlink_bandwidth=600 * GB
    ),
    "H200": GPUSpec(
        "H200", peak_flops=989e12, hbm_bandwidth=4.8 * TB, memory_bytes=141 * GB, nvlink_bandwidth=900 * GB
    ),
}

MODELS: dict[str, ModelSpec] = {
    "1.5B": ModelSpec("1.5B", params=1.54e9, layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128),
    "7B": ModelSpec("7B", params=7.61e9, layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128),
    "32B": ModelSpec("32B", params=32.5e9, layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128),
}


def _preset(value, cls: type, table: dict, field: str):
    if isinstance(value, cls):
        return value
    if value not in table:
        raise ValueError(f"{field}: unknown preset {value!r}; presets: {sorted(table)} (or pass a {cls.__name__})")
    return table[value]


def gpu_spec(gpu: GPUSpec | str) -> GPUSpec:
    return _preset(gpu, GPUSpec, GPUS, "gpu")


def model_spec(model: ModelSpec | str) -> ModelSpec:
    return _preset(model, ModelSpec, MODELS, "model")
