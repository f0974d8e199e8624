"""One hash for a model's weights, the same in the trainer, the rollout servers and replays."""

from __future__ import annotations

import hashlib

import torch


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the model's tensors (name, dtype, shape and bytes, in name order): equal exactly
    when every weight is equal bit for bit, whatever file format holds them."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy
    return h.hexdigest()
