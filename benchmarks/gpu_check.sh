#!/usr/bin/env bash
# The prepared check for a machine with one GPU (its own JAX, no network).
# Writes logs under ${OUT:-out/gpu}. With one GPU there is no ring to time,
# so it checks compatibility and runs what a single device can:
#   1. the fast test suite on that machine's JAX (CPU backend, 8 simulated
#      devices, as in CI),
#   2. benchmarks/gpu_smoke.py on the GPU,
#   3. the digits demo (simulated CPU devices: one GPU cannot host 8 ranks).
set -u
out=${OUT:-out/gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/nvidia-smi.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/jax.txt"
JAX_PLATFORMS=cpu timeout 300 python3 -m pytest -q -m "not slow" -p no:cacheprovider \
  --maxfail=30 -W "ignore::DeprecationWarning" > "$out/tests.txt" 2>&1
tail -25 "$out/tests.txt"
timeout 120 python3 benchmarks/gpu_smoke.py 2>&1 | tee "$out/gpu_smoke.txt" | tail -30
timeout 180 python3 examples/train_digits.py --no-progress --out "$out/digits" 2>&1 \
  | tee "$out/digits.txt" | tail -16
