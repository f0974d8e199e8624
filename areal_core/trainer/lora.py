"""Low-rank adapters (LoRA) on a Llama-family decoder's projections, and the one merge of them.

``apply_lora`` turns each target ``nn.Linear`` (``q_proj`` ... ``down_proj`` of every layer) into a
:class:`LoRALinear` in place: its class changes, its ``weight`` and ``bias`` stay the same
parameters under the same names (frozen), and it gains ``lora_A`` [r, in] (kaiming-uniform, drawn
from the run's seed) and ``lora_B`` [out, r] (zeros), always float32. Its forward is
``base(x) + (x A^T) B^T * alpha / r``, so the trainer's packed forward, which calls the modules
(``attn.q_proj(x)``, ``layer.mlp(h)``), runs adapters without knowing about them. Every other
parameter is frozen: only adapters train.

Merging. ``merge_weight`` (``storage/adapters.py``, where checkpoints need it too) is the only place
a merged weight is computed:
``W = (float32(W_base) + B_s @ A).to(W_base.dtype)`` with ``B_s = lora_B * alpha / r``
(:func:`scaled_b`). The rollout engine (:class:`AdapterMerger`), checkpoint materialisation and
export (:func:`merge_state`) and the transports that send full weights (:func:`merged_weights`)
all call it with the same operands in the same order, so on one machine they agree bit for bit.
``B_s`` is what travels to the servers (the scale is folded into B on the sender); checkpoints hold
the unscaled ``lora_B`` with ``alpha`` and ``rank`` in ``adapter_config.json``, and
:func:`scaled_b` rebuilds ``B_s`` exactly (one float32 multiply by the same Python float).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# the adapters' names, files and arithmetic are storage's (a checkpoint holds them), imported here
from areal_core.storage.adapters import (  # noqa: F401 - part of this module's face
    A_SUFFIX,
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    B_SUFFIX,
    BASE_VERSION,
    CONFIG_FORMAT,
    _check_pair,
    adapter_pairs,
    is_adapter_name,
    merge_state,
    merge_weight,
    scale_of,
    scaled_b,
)


class LoRALinear(torch.nn.Linear):
    """An ``nn.Linear`` (frozen ``weight``/``bias``) plus float32 ``lora_A`` and ``lora_B``."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        low = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale
        return out + low.to(out.dtype)


def apply_lora(
    model: torch.nn.Module, rank: int, alpha: float, targets: list[str] | tuple[str, ...], seed: int
) -> list[str]:
    """Put adapters on every ``nn.Linear`` of the decoder layers named (last part) in ``targets``
    and freeze every other parameter; returns the adapted modules' names. ``lora_A`` is drawn from a
    generator seeded with ``seed`` (the same run seed gives the same adapters), ``lora_B`` is zero,
    so the adapted model computes what the base does until the first step."""
    if is_lora(model):
        raise ValueError("the model already has adapters")
    wanted = set(targets)
    layers = model.model.layers
    found = [
        (f"model.layers.{i}.{n}", m)
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if n.rsplit(".", 1)[-1] in wanted and type(m) is torch.nn.Linear
    ]
    missing = wanted - {name.rsplit(".", 1)[-1] for name, _ in found}
    if missing:
        raise ValueError(
            f"trainer.lora.targets: the model's decoder layers have no nn.Linear named "
            f"{sorted(missing)} (a {type(model).__name__})"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    scale = scale_of(rank, alpha)
    for _, m in found:
        a = torch.empty(rank, m.in_features, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # nn.Linear's own init
        m.__class__ = LoRALinear
        m.lora_A = torch.nn.Parameter(a.to(m.weight.device))
        m.lora_B = torch.nn.Parameter(torch.zeros(m.out_features, rank, dtype=torch.float32, device=m.weight.device))
        m.scale = scale
        m.lora_rank, m.lora_alpha = rank, float(alpha)
    return [name for name, _ in found]


def lora_modules(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_lora(model: torch.nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_config(model: torch.nn.Module) -> dict:
    """What ``adapter_config.json`` records: enough to merge the adapters into checkpoint v0."""
    mods = lora_modules(model)
    first = next(iter(mods.values()))
    return {
        "format": CONFIG_FORMAT,
        "rank": first.lora_rank,
        "alpha": first.lora_alpha,
        "targets": sorted({n.rsplit(".", 1)[-1] for n in mods}),
        "modules": list(mods),
        "base_version": BASE_VERSION,
    }


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as the trainer holds them (unscaled ``lora_B``), by ``<module>.lora_A/B``: what a
    checkpoint stores. Live tensors: clone before the trainer steps again."""
    out = {}
    for n, m in lora_modules(model).items():
        out[n + A_SUFFIX] = m.lora_A.detach()
        out[n + B_SUFFIX] = m.lora_B.detach()
    return out


def load_adapters(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy adapters saved by :func:`adapter_tensors` into ``model``; every module's, same shapes."""
    mine = adapter_tensors(model)
    if set(tensors) != set(mine):
        missing, extra = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        raise ValueError(f"{source}: adapters do not match the model's (missing {missing[:3]}, unknown {extra[:3]})")
    with torch.no_grad():
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(mine[name].shape):
                raise ValueError(
                    f"{source}: {name} has shape {tuple(t.shape)}, the model's is {tuple(mine[name].shape)}"
                )
            mine[name].copy_(t)


def wire_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA model sends to servers that merge (the embedded engine): ``lora_A`` and the
    pre-scaled ``lora_B`` (:func:`scaled_b`) of every adapted module, float32."""
    out = {}
    for n, m in lora_modules(model).items():
        out[n + A_SUFFIX] = m.lora_A.detach()
        out[n + B_SUFFIX] = scaled_b(m.lora_B.detach(), m.scale)
    return out


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the base model by its name (a tied one once), adapted weights merged:
    what a LoRA model sends to servers that load whole weights (disk, SGLang)."""
    mods = lora_modules(model)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith((A_SUFFIX, B_SUFFIX)):
            continue
        m = mods.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        out[name] = p.detach() if m is None else merge_weight(p, m.lora_A, scaled_b(m.lora_B, m.scale))
    return out


@contextlib.contextmanager
def without_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model as its base while inside (the adapters leave its parameters and state dict), e.g. to
    save or load the base weights under their plain names. Nothing changes for a model without."""
    taken = []
    for m in lora_modules(model).values():
        taken.append((m, m._parameters.pop("lora_A"), m._parameters.pop("lora_B")))
        m.__class__ = torch.nn.Linear
    try:
        yield model
    finally:
        for m, a, b in taken:
            m.__class__ = LoRALinear
            m.lora_A, m.lora_B = a, b


def check_adapters(model: torch.nn.Module, named: dict[str, torch.Tensor], source: str) -> None:
    """Adapters sent to a server checked against its model: every module a 2-D weight of the model,
    shapes that fit it, float32, both halves present."""
    params = dict(model.named_parameters())
    for mod, (a, b) in adapter_pairs(named, source).items():
        w = params.get(mod + ".weight")
        if w is None or w.dim() != 2:
            raise ValueError(f"{source}: adapters for {mod!r}, but the model has no linear weight {mod}.weight")
        _check_pair(mod, a, b, tuple(w.shape), source)


class AdapterMerger:
    """The rollout engine's side: the base values of the adapted weights, captured at the first
    adapter update, and every adapter update merged into them (:func:`merge_weight`), giving full
    weights to load. Adapters are made against the run's base, checkpoint v0 (``BASE_VERSION``): a
    server that holds another version's full weights (started from a merged checkpoint) refuses
    them, rather than merging them into weights that already hold earlier adapters.

    ``version``: the version of the full weights the server holds (at start: what it loaded)."""

    def __init__(self, version: int = BASE_VERSION) -> None:
        self._base: dict[str, torch.Tensor] | None = None
        self.full_version = version
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._base is not None

    def stage(
        self, model: torch.nn.Module, named: dict[str, torch.Tensor], source: str, version: int
    ) -> dict[str, torch.Tensor]:
        """Weights to load for a checked update to ``version``: an adapter update becomes the merged
        target weights; full weights pass through (and forget the captured base: they are a new model)."""
        if not any(is_adapter_name(n) for n in named):
            with self._lock:
                self._base, self.full_version = None, version
            return named
        pairs = adapter_pairs(named, source)
        with self._lock, torch.no_grad():
            if self._base is None and self.full_version != BASE_VERSION:
                raise ValueError(
                    f"{source}: adapters are made against checkpoint v{BASE_VERSION}, the run's base, and this "
                    f"server holds the full weights of v{self.full_version}: restart it from v{BASE_VERSION}"
                )
            if self._base is None:
                params = dict(model.named_parameters())
                self._base = {m: params[m + ".weight"].detach().clone() for m in pairs}
            elif set(pairs) != set(self._base):
                raise ValueError(
                    f"{source}: adapters for {len(pairs)} modules, the earlier updates' were for "
                    f"{len(self._base)} (e.g. {sorted(set(pairs) ^ set(self._base))[:3]})"
                )
            return {m + ".weight": merge_weight(self._base[m], a, b) for m, (a, b) in pairs.items()}
