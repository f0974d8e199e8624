"""Load the base policy named by a ModelConfig: tiny, smollm2-135m or an HF folder."""

from __future__ import annotations

import logging

import torch
import transformers

from areal_core.data.records import Record
from areal_core.device import resolve_device, resolve_dtype, resolve_servers_dtype
from areal_core.models.config import ModelConfig
from areal_core.models.tokenizer import load_tokenizer
from areal_core.storage.localize import localize

log = logging.getLogger(__name__)


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def model_dtype(model_cfg: ModelConfig) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` the trainer's policy computes in: the tiny model always in float32, others by
    ``model.dtype`` (``auto``: bfloat16 on a GPU, float32 on a CPU; ``device.resolve_dtype``)."""
    if model_cfg.name == "tiny":
        return torch.float32, "the tiny model runs in float32"
    return resolve_dtype(model_cfg.dtype, resolve_device(model_cfg.device))


def servers_model_dtype(model_cfg: ModelConfig) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` the rollout servers compute in under ``rollout.dtype: model``: the tiny model
    always in float32, others by ``model.dtype`` (``auto``: bfloat16 where the device has bfloat16
    matrix units; ``device.resolve_servers_dtype``)."""
    if model_cfg.name == "tiny":
        return torch.float32, "the tiny model runs in float32"
    return resolve_servers_dtype(model_cfg.dtype, resolve_device(model_cfg.device))


def load_hf_folder(url_or_path: str, dtype: torch.dtype | str = torch.float32, cache_dir: str | None = None):
    """(model, tokenizer) from an HF checkpoint folder: a local path, file:// or any fsspec URL.

    Remote folders are copied once to a local cache (``localize``). Nothing is
    fetched from a model hub: a name that is not a folder is an error.
    """
    folder = localize(url_or_path, cache_dir=cache_dir)
    tokenizer = load_tokenizer(folder, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(dtype), local_files_only=True)
    model.eval()
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_base_model(
    model_cfg: ModelConfig,
    *,
    train_records: list[Record] | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
    progress: bool = True,
    task: dict | None = None,
    info: dict | None = None,
):
    """(model, tokenizer) of the policy to start RL from.

    ``tiny``: the char tokenizer and a freshly built tiny model, warm-started
    (cached, see ``cached_warm_start``) on the train records' (prompt,
    solution) pairs when ``warm_start.steps > 0``. ``smollm2-135m``: the
    packaged GGUF model. Anything else: an HF folder (path or URL).
    ``cache_dir`` is the warm-start cache for ``tiny`` and the copy cache for
    remote folders. Pass a dict as ``info`` to receive the warm start's stats
    and the path of its optimizer moments (``info["warm_start"]``).
    """
    name = model_cfg.name
    if name == "tiny":
        from areal_core.models.tiny import build_tiny
        from areal_core.models.tokenizer import build_char_tokenizer
        from areal_core.models.warmstart import cached_warm_start

        if model_cfg.dtype == "bfloat16":
            log.warning("tiny model runs in float32 (config asks for %s)", model_cfg.dtype)
        if model_cfg.warm_start.steps == 0:
            tokenizer = build_char_tokenizer()
            return build_tiny(model_cfg.tiny, tokenizer, seed), tokenizer
        pairs, weights, val_pairs = warm_start_inputs(model_cfg, train_records)
        model, tokenizer, ws_info = cached_warm_start(
            model_cfg.tiny,
            model_cfg.warm_start,
            pairs,
            seed,
            task=task,
            cache_dir=cache_dir,
            progress=progress,
            weights=weights,
            val_pairs=val_pairs,
        )
        if info is not None:
            info["warm_start"] = ws_info
        log.info(
            "tiny warm start %s: final loss %.4f (%s)",
            "loaded from cache" if ws_info["cached"] else f"trained in {ws_info['wall_s']:.1f}s",
            ws_info["final_loss"],
            ws_info["path"],
        )
        return model, tokenizer
    if name == "smollm2-135m":
        from areal_core.models.smollm2 import load_smollm2

        return load_smollm2(model_dtype(model_cfg)[0])
    return load_hf_folder(name, model_dtype(model_cfg)[0], cache_dir=cache_dir)


def warm_start_inputs(model_cfg: ModelConfig, train_records: list[Record] | None):
    """``(pairs, weights, val_pairs)`` the tiny model's warm start trains and validates on.

    Demonstrations are the train records with a solution; with ``stop_at_accuracy``
    the last ``val_problems`` of them are the validation split and the rest teach.
    ``weights`` follow ``length_alpha`` (chain task), else None.
    """
    from areal_core.models.warmstart import chain_length_weights

    if not train_records:
        raise ValueError("tiny model with warm_start.steps > 0 needs train_records to warm start on")
    demos = [r for r in train_records if r.solution]
    if not demos:
        raise ValueError("no train record has a solution to warm start on")
    ws = model_cfg.warm_start
    val_pairs = None
    if ws.stop_at_accuracy is not None:
        if len(demos) < 2 * ws.val_problems:
            raise ValueError(
                f"model.warm_start.val_problems ({ws.val_problems}) needs at least twice as many train "
                f"records with a solution; there are {len(demos)}"
            )
        val_pairs = [(r.prompt, r.solution) for r in demos[-ws.val_problems :]]
        demos = demos[: -ws.val_problems]
    weights = None
    if ws.length_alpha is not None:
        missing = next((r.id for r in demos if "k" not in (r.meta or {})), None)
        if missing is not None:
            raise ValueError(
                f"model.warm_start.length_alpha needs chain-task records with a chain length "
                f"(meta.k); record {missing!r} has none (use data.dataset: synthetic)"
            )
        weights = chain_length_weights([int(r.meta["k"]) for r in demos], ws.length_alpha)
    return [(r.prompt, r.solution) for r in demos], weights, val_pairs
