#!/usr/bin/env bash
# The prepared check for a machine with one GPU (its own Python and JAX, no
# network), about 7 minutes on 16 cores. Writes under ${OUT:-out/gpu}:
#   env.txt                 nvidia-smi, the Python packages' versions
#   smoke.json              benchmarks/gpu_smoke.py on the GPU (N = 1: local costs)
#   pjit_gpu.json           examples/pjit_lm.py on a 1-device GPU mesh, k = 0,
#   pjit_gpu_highest.json   default and highest matmul precision, each compared
#                           with benchmarks/results/gpu/pjit_lm_cpu.json (CPU run)
#   pods.txt, pods_nobias.txt  benchmarks/pods.py --pod gpu-1x8 --biases with,
#                           without: the 8 x H100 step compiled deviceless (as
#                           make check-pods does)
#   tests.txt               the fast suite on this JAX (CPU backend, 8 simulated
#                           devices, as in CI), run beside the pods compile
#   log.txt                 everything else the steps print
# Each step has its own timeout; a failing step does not stop the others.
# SUITE_ARGS (default: the whole fast suite) and WORKERS (default 12) change
# the test step, SMOKE_ARGS and PJIT_TIMEOUT (default 50 s) the others, e.g.
# for a rehearsal on a small machine.
set -u
out=${OUT:-out/gpu}; mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=$out/log.txt
step() { echo "== $(date +%T) $*" | tee -a "$log"; }

step env
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $py -c "import sys; print(sys.version)"; nproc
  $py -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda\S*|flax|optax|orbax-checkpoint|chex|numpy|pytest|pytest-xdist|hypothesis|scikit-learn|ml.dtypes)\s"
  $py -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"

step gpu_smoke
timeout 110 $py benchmarks/gpu_smoke.py --out "$out/smoke.json" ${SMOKE_ARGS:-} >> "$log" 2>&1
echo "rc $?" | tee -a "$log"

ref=benchmarks/results/gpu/pjit_lm_cpu.json
pjit=(--mesh one --skip-ratio 0 --steps 20 --eval-every 5)
step pjit default precision
timeout ${PJIT_TIMEOUT:-50} $py benchmarks/gpu_pjit.py --out "$out/pjit_gpu.json" --compare "$ref" --rtol 1e-2 \
  -- "${pjit[@]}" >> "$log" 2>&1
echo "rc $?" | tee -a "$log"
step pjit highest precision
timeout ${PJIT_TIMEOUT:-50} $py benchmarks/gpu_pjit.py --out "$out/pjit_gpu_highest.json" --compare "$ref" \
  --rtol 1e-4 --precision highest -- "${pjit[@]}" >> "$log" 2>&1
echo "rc $?" | tee -a "$log"

# CPU only from here: the suite and the deviceless compile side by side.
step tests and pods
timeout_flag=$($py -c "import pytest_timeout" 2>/dev/null && echo --timeout=150)
# shellcheck disable=SC2086
JAX_PLATFORMS=cpu timeout 210 $py -m pytest -q -m "not slow" -n "${WORKERS:-12}" \
  -p no:cacheprovider -p no:benchmark -rfE --durations=15 -W "default::DeprecationWarning" $timeout_flag \
  ${SUITE_ARGS:-} > "$out/tests.txt" 2>&1 &
tests=$!
timeout 110 $py benchmarks/pods.py --pod gpu-1x8 --biases with > "$out/pods.txt" 2>&1
echo "pods (biases) rc $?" | tee -a "$log"
timeout 90 $py benchmarks/pods.py --pod gpu-1x8 --biases without > "$out/pods_nobias.txt" 2>&1
echo "pods (no biases) rc $?" | tee -a "$log"
wait $tests
echo "tests rc $?" | tee -a "$log"
step done
tail -n 4 "$out/pods.txt" "$out/pods_nobias.txt"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | tail -40
