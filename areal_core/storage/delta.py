"""The delta weight format: a version's weights as a lossless difference to a full version.

Why an XOR and not "only the tensors that changed": an AdamW step moves every
weight a little, so in RL training every tensor changes. But a small move of a
float leaves its sign, exponent and top mantissa bits alone: ``new XOR base`` is
zero in those bits. Split into byte planes (byte k of every element together) the
high planes are nearly all zero and compress to almost nothing, the low planes are
noise and are stored as they are. XOR is exact for any dtype (no float arithmetic),
so the reconstruction is bit for bit; an unchanged tensor is recorded as such
(zero bytes), and a sparse change compresses to nearly nothing.

File ``model.delta``::

    b"AREALDELTA1\\n" | header length (8 bytes, little endian) | JSON header | blobs

The header names the base version and, per tensor, its dtype, shape, the sha256
of its new bytes (checked after reconstruction) and its planes as
``[offset, length, codec]`` (codec ``zlib`` or ``raw``) into the blobs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib

import numpy as np
import torch
from safetensors.torch import load_file

from areal_core.storage.manifest import MANIFEST
from areal_core.storage.snapshot import WEIGHTS, write_weights

DELTA = "model.delta"
MAGIC = b"AREALDELTA1\n"
_PROBE = 1 << 16  # compress this much of a plane first; store the plane raw if it does not shrink
_MIN_GAIN = 0.9


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _pack_plane(plane: bytes, level: int) -> tuple[bytes, str]:
    if len(zlib.compress(plane[:_PROBE], level)) > _MIN_GAIN * min(len(plane), _PROBE):
        return plane, "raw"
    packed = zlib.compress(plane, level)
    return (packed, "zlib") if len(packed) < len(plane) else (plane, "raw")


def encode(base_version: int, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], level: int = 1) -> bytes:
    """The delta of ``new`` against ``base`` (same names, dtypes, shapes), as file bytes."""
    if set(base) != set(new):
        missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        raise ValueError(
            f"delta against v{base_version}: tensor names differ "
            f"(not in the new weights: {missing[:3]}, not in the base: {extra[:3]})"
        )
    header: dict = {"base_version": base_version, "tensors": {}}
    blobs: list[bytes] = []
    offset = 0
    for name, t in new.items():
        b = base[name]
        if t.dtype != b.dtype or t.shape != b.shape:
            raise ValueError(
                f"delta against v{base_version}: {name} is {t.dtype} {tuple(t.shape)}, "
                f"the base's {b.dtype} {tuple(b.shape)}"
            )
        raw_new = _bytes_of(t)
        entry = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "sha256": hashlib.sha256(raw_new).hexdigest(),
            "planes": [],
        }
        diff = np.bitwise_xor(raw_new, _bytes_of(b))
        if diff.any():
            width = t.element_size()
            for plane in np.ascontiguousarray(diff.reshape(-1, width).T):
                data, codec = _pack_plane(plane.tobytes(), level)
                entry["planes"].append([offset, len(data), codec])
                blobs.append(data)
                offset += len(data)
        header["tensors"][name] = entry
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)


def read_header(data: bytes, what: str) -> tuple[dict, int]:
    """(header, offset of the blobs); ValueError naming ``what`` if it is not a delta file."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ValueError(f"{what}: not a delta file (bad magic)")
    n = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    try:
        header = json.loads(data[start : start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what}: bad delta header ({err})") from err
    return header, start + n


def decode(data: bytes, base: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The full weights: ``base`` with the delta in ``data`` applied; each tensor's sha256 checked."""
    header, blobs = read_header(data, what)
    out: dict[str, torch.Tensor] = {}
    for name, e in header["tensors"].items():
        if name not in base:
            raise ValueError(f"{what}: tensor {name} is not in the base v{header['base_version']}")
        b = base[name]
        if str(b.dtype).removeprefix("torch.") != e["dtype"] or list(b.shape) != e["shape"]:
            raise ValueError(f"{what}: {name} is {e['dtype']} {e['shape']}, the base's {b.dtype} {list(b.shape)}")
        raw = _bytes_of(b).copy()
        if e["planes"]:
            width = b.element_size()
            if len(e["planes"]) != width:
                raise ValueError(f"{what}: {name} has {len(e['planes'])} byte planes, its dtype {width}")
            planes = []
            for off, length, codec in e["planes"]:
                chunk = data[blobs + off : blobs + off + length]
                planes.append(np.frombuffer(zlib.decompress(chunk) if codec == "zlib" else chunk, np.uint8))
            raw ^= np.stack(planes).T.reshape(-1)
        if hashlib.sha256(raw).hexdigest() != e["sha256"]:
            raise ValueError(
                f"{what}: {name} does not match its sha256 after reconstruction "
                f"(is v{header['base_version']} the base it was made against?)"
            )
        out[name] = torch.from_numpy(raw).view(b.dtype).reshape(b.shape)
    missing = sorted(set(base) - set(out))
    if missing:
        raise ValueError(f"{what}: the delta lacks {len(missing)} tensors of its base, e.g. {missing[:3]}")
    return {n: out[n] for n in header["tensors"]}


def materialise(raw_folder: str, base_folder: str, dest: str) -> str:
    """Build at ``dest`` a full HF folder: the files of the delta version in ``raw_folder``
    (but its delta and manifest) and ``model.safetensors`` = base + delta, bit for bit.

    Built in a temporary folder renamed into place, so ``dest`` is whole or absent."""
    if os.path.isdir(dest):
        return dest
    base_weights = os.path.join(base_folder, WEIGHTS)
    if not os.path.isfile(base_weights):
        raise FileNotFoundError(f"{base_folder}: the delta's base has no {WEIGHTS}")
    with open(os.path.join(raw_folder, DELTA), "rb") as f:
        data = f.read()
    tensors = decode(data, load_file(base_weights), f"{raw_folder}/{DELTA}")
    return build_folder(raw_folder, dest, tensors, skip=(DELTA,))


def build_folder(raw_folder: str, dest: str, tensors: dict[str, torch.Tensor], skip: tuple[str, ...]) -> str:
    """``dest``: the files of ``raw_folder`` but ``skip`` and the manifest, and ``tensors`` as its
    ``model.safetensors``. Built in a temporary folder renamed into place (whole or absent)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".partial-")
    try:
        for dirpath, _, names in os.walk(raw_folder):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), raw_folder)
                if rel in skip or rel == MANIFEST:
                    continue
                os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
                shutil.copyfile(os.path.join(dirpath, name), os.path.join(tmp, rel))
        write_weights(tensors, os.path.join(tmp, WEIGHTS))
        try:
            os.rename(tmp, dest)
        except OSError:  # another reader built it meanwhile
            if not os.path.isdir(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
