"""The engine process's malloc settings (rollout/backends/embedded/malloc.py): the large tensors of
each decode step (logits over a 49,152-token vocabulary at batch 64) reuse freed pages instead of
faulting fresh ones in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, random, resource, sys, torch
from areal_core.rollout.backends.embedded.malloc import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
from areal_core.models.decoder_weights import DecoderWeights, plain_config
from infra.gpu_smoke.engine_part import run_engine
torch.manual_seed(0)
torch.set_num_threads(1)
# a config.json's fields, read as a server reads them (no transformers import: it is most of the start-up)
cfg = plain_config(dict(model_type="llama", hidden_act="silu", vocab_size=49152, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False, rope_theta=10000.0))
model = DecoderWeights(cfg).eval()  # what a server loads (a process without transformers' modeling code)
for p in model.parameters():  # (allocated, not initialised)
    torch.nn.init.normal_(p, 0, 0.02)
r = random.Random(0)
batch = [[r.randrange(3, 49152) for _ in range(16)] for _ in range(64)]
faults = []
for new in (4, 16, 16, 16):  # the first two warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run_engine(model, batch, new)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": sum(faults[2:])}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_the_steps_large_tensors_reuse_freed_pages():
    # kept, the pages are reused in every process (measured 0 to 6,150 faults over two batches of 16 steps in
    # 15 processes: at most two faults of a 12 MB logits block, where the defaults fault one every step)
    for _ in range(2):
        kept = probe("keep")
        assert kept["kept"] is True and kept["faults"] < 10_000, kept
    # the control: with glibc's own thresholds the heap's top is given back and faults in again in most
    # processes (measured 150,000-200,000 faults over two batches of 16 steps), not in all: glibc moves
    # its thresholds as the first large blocks are freed, and where those lie differs between processes
    # (about one in four measured 6 to 21,000). So the control is the most of up to 5 processes.
    defaults: list[int] = []
    while len(defaults) < 5 and max(defaults, default=0) <= 50_000:
        defaults.append(probe("default")["faults"])
    assert max(defaults) > 50_000, defaults
