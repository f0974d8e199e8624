"""What a trained model publishes: its checkpoints, its weight pushes, and the version a (re)started
rollout server loads. The run, the checkpoints and the weight transports ask :func:`published`; only
the trainer knows whether the model trains whole (:class:`FullWeights`) or through low-rank adapters
on a frozen base (:class:`Adapters`, ``trainer/lora.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import load as load_safetensors

from areal_core.models.weights import apply_weights, read_weights
from areal_core.storage import CheckpointStore
from areal_core.storage.adapters import ADAPTER_FILE
from areal_core.storage.snapshot import cpu_copy, snapshot_files, snapshot_model
from areal_core.trainer import lora


@dataclass
class CheckpointParts:
    """One checkpoint's contents: tensors to write, the other files, and an adapter config (None: whole weights)."""

    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes]
    adapter_config: dict | None


class Published(Protocol):
    serves_a_base: bool
    """Whether servers hold a base the trained weights are pushed onto (not a version's whole weights)."""

    def serving_version(self, version: int) -> int:
        """The checkpoint a rollout server (re)starts from when the trainer is at ``version``."""

    def base(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The model as checkpoint v0 holds it, for the block's duration."""

    def checkpoint(self, model: torch.nn.Module, tokenizer) -> CheckpointParts:
        """What a checkpoint of ``model`` holds (copies: training may go on while it is written)."""

    def restore(self, store: CheckpointStore, model: torch.nn.Module, version: int) -> None:
        """Load checkpoint ``version`` of ``store`` into ``model``."""

    def pushed(self, model: torch.nn.Module, adapters: bool, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The tensors a weight push sends, by name (``adapters``: the servers merge adapters themselves);
        whole weights cast to ``dtype``, the servers' (None: as they are)."""

    def loadable(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], contextlib.AbstractContextManager]:
        """Whole weights in the layout a server loads from a folder, and the model to save them with."""


class FullWeights:
    """A model trained whole: every checkpoint and push holds all its weights."""

    serves_a_base = False

    def serving_version(self, version: int) -> int:
        return version

    def base(self, model):
        return contextlib.nullcontext(model)

    def checkpoint(self, model, tokenizer) -> CheckpointParts:
        tensors, files = snapshot_model(model, tokenizer)
        return CheckpointParts(tensors, files, None)

    @torch.no_grad()
    def restore(self, store, model, version) -> None:
        apply_weights(model, read_weights(model, store.local_copy(version)))

    def pushed(self, model, adapters, dtype):
        return _cast({n: p.detach() for n, p in model.named_parameters()}, dtype)

    def loadable(self, model):
        return None, contextlib.nullcontext(model)


class Adapters:
    """Low-rank adapters on a frozen base: checkpoint v0 is the base, every later checkpoint the
    adapters against it; servers start from the base and receive the adapters (or, where they load
    whole weights, the merge)."""

    serves_a_base = True

    def serving_version(self, version: int) -> int:
        return lora.BASE_VERSION

    def base(self, model):
        return lora.without_adapters(model)

    def checkpoint(self, model, tokenizer) -> CheckpointParts:
        tensors = {n: cpu_copy(t) for n, t in lora.adapter_tensors(model).items()}
        return CheckpointParts(tensors, snapshot_files(model, tokenizer), lora.adapter_config(model))

    @torch.no_grad()
    def restore(self, store, model, version) -> None:
        """The base from v0 and, after v0, the adapters the version holds (v0's are the fresh ones
        ``lora.apply_lora`` made)."""
        with lora.without_adapters(model):
            apply_weights(model, read_weights(model, store.local_copy(lora.BASE_VERSION)))
        if version != lora.BASE_VERSION:
            saved = load_safetensors(store.read_file(version, ADAPTER_FILE))
            lora.load_adapters(model, saved, f"{store.version_url(version)}/{ADAPTER_FILE}")

    def pushed(self, model, adapters, dtype):
        """The adapters (``lora_A`` and the pre-scaled ``lora_B``, float32), or the merged weights."""
        return lora.wire_adapters(model) if adapters else _cast(lora.merged_weights(model), dtype)

    def loadable(self, model):
        return lora.merged_weights(model), lora.without_adapters(model)


def _cast(named: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {n: t if dtype is None or not t.is_floating_point() else t.to(dtype) for n, t in named.items()}


def published(model: torch.nn.Module) -> Published:
    """How ``model`` publishes itself: through adapters where it carries them, else whole."""
    return Adapters() if lora.is_lora(model) else FullWeights()


@contextlib.contextmanager
def as_base(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` as checkpoint v0 holds it (its base, for a model with adapters)."""
    with published(model).base(model) as m:
        yield m


def stored_base(trainer_cfg, version: int) -> int:
    """The checkpoint whose files hold the whole model that ``version`` of a run with ``trainer_cfg``
    builds on: the version itself, or the base v0 where only adapters train."""
    return lora.BASE_VERSION if trainer_cfg.lora is not None else version


def trainable(model: torch.nn.Module, trainer_cfg, seed: int) -> torch.nn.Module:
    """``model`` as the trainer trains it: with low-rank adapters where ``trainer.lora`` asks (its
    base frozen), else as it is."""
    lc = trainer_cfg.lora
    if lc is not None:
        lora.apply_lora(model, lc.rank, lc.alpha, lc.targets, seed=seed)
    return model
