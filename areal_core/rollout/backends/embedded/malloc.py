"""glibc malloc settings for a process that runs the engine on a CPU.

Each decode step allocates a few tensors of megabytes: the logits in the model's dtype and in
float32 and the sampler's probabilities, about 31 MB a step at batch 64 over SmolLM2's 49,152-token
vocabulary. glibc serves a block above its mmap threshold (128 KiB at start) with a fresh ``mmap``
whose pages the kernel zeroes at first touch, and unmaps it at ``free``. It raises that threshold
after the first such ``free``, but it also gives back the top of the heap once more than twice the
threshold lies free there, so the same pages fault in again a step later: on a 2-core AMD EPYC, 8,000
page faults a step and 640 against 720 tokens/s for SmolLM2 in bfloat16 at batch 64.

:func:`keep_freed_memory` fixes both thresholds (which also stops glibc's adjusting them): blocks up
to 32 MiB (glibc's largest mmap threshold) come from the heap, and up to 1 GiB of free memory at its
top is kept for the next step. The process keeps what it once held at its peak instead of returning
it (its resident size does not shrink after a large batch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit machines
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # the heap grows by this much beyond a request, fewer brk calls


def keep_freed_memory() -> bool:
    """Set this process's malloc thresholds (see the module docstring); False where the C library
    is not glibc (nothing is changed there)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.warning("glibc refused a malloc threshold: the engine's large tensors may fault in anew each step")
    return ok
