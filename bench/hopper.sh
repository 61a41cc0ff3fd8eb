#!/usr/bin/env bash
# One short session on an H100 or H200: the Hopper benches, then the kernel
# tests un-interpreted, within a deadline (the device time is short).
#
#   OUT=results [STEPS="tune ragged_bench ..."] [TUNE="ragged attention"] \
#     bash bench/hopper.sh [seconds, default 480]
#
# Steps (STEPS picks some and runs them in its order; default all, in this order):
# - tune: bench/hopper_tune.py (its cases: TUNE), every candidate of the benches' kernel calls
#   timed (what the heuristics should pick), the winners exported to tuned.json.
# - fused_smoke: the fused dq backward's causal and two-consumer tests, the consumers
#   sharing dQ's columns with padded keys too and in 64-query steps, causal too (fuse_dq: TMA
#   reduce-adds and a barrier a step, never run on a GPU before) compiled and run on
#   the GPU; if they fail, hang or are not run (the deadline), attention_bench and
#   attention_breakdown leave pallax-fused, pallax-fused2 and pallax-fa3 out
#   (PALLAX_BENCH_FUSED=0), so a hang there costs this step's cap, not the bench's
#   numbers: list it before them.
# - attention_bench: bench/test_attention_hopper.py, Mosaic GPU attention vs
#   Pallas-Triton vs cuDNN (forward, forward+backward), and vs XLA under jvp
#   (where cuDNN's custom_vjp raises); the forward's candidate with its
#   softmax beside the previous block's P V too (pallax-overlap), its 192-key
#   blocks (pallax-k192, not causal), and the forward with a bias of every head
#   (test_hopper_biased_forward: the Mosaic GPU forward pinned, an autotuning
#   candidate, against Triton and cuDNN), its tangent (test_hopper_biased_tangent:
#   the Mosaic GPU forward and tangent pinned against Triton) and its gradient
#   along the bias too (test_hopper_biased_backward: the Mosaic GPU forward and
#   backward pinned against Triton and cuDNN; last in the file).
# - attention_breakdown: bench/attention_breakdown.py, the device's kernels of
#   pallax's, cuDNN's and JAX's Mosaic GPU attention at B=4, S=4096, and of the
#   fused backward's two-consumer configs (pallax-fused2, pallax-fa3).
# - matmul_bench: bench/test_matmul_hopper.py, Mosaic GPU matmul vs the
#   executor's choice vs cuBLAS.
# - paged_bench: bench/test_paged_attention.py, the full-context decode case
#   (HBM bandwidth).
# - ragged_bench: bench/test_ragged_paged_attention.py, a mixed serving step
#   and a decode step (tokens/s, HBM bandwidth).
# - ragged_breakdown: bench/ragged_breakdown.py, a decode step's time by piece
#   and the device's kernels, ragged paged attention beside paged attention.
# - mosaic_tests: tests/primitives/test_attention_mosaic_gpu.py, every case
#   (-m slow too) with its Mosaic GPU kernels compiled and run on the GPU.
# - tests: the attention, matmul and paged attention tests under
#   PALLAX_TEST_PLATFORM=gpu (the executor's own kernels compiled and run; the
#   TPU kernels' interpreted cases are left to the CPU run).
# - serving_tests: the same for ragged paged attention (its Mosaic GPU kernel
#   pinned, compiled), the KV-cache write, rotary embeddings and the
#   continuous-batching loop.
# Each step's log and JSON land in $OUT; each step gets what is left of the
# deadline, capped, so a hang in one leaves time for the rest.
set -u
cd "$(dirname "$0")/.."
deadline=$(($(date +%s) + ${1:-480}))
out="${OUT:-/tmp/hopper}"
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

left() { echo $((deadline - $(date +%s))); }
budget() { local l; l=$(left); echo $((l < $1 ? l : $1)); }
all="tune fused_smoke attention_bench attention_breakdown matmul_bench paged_bench ragged_bench"
all+=" ragged_breakdown mosaic_tests tests serving_tests"
steps="${STEPS:-$all}"
step() {  # step NAME CAP_SECONDS COMMAND...: the command under the smaller of the cap and what is left
  # Returns the command's status (124 for one not run).
  local name=$1 cap=$2 s rc
  shift 2
  s=$(budget "$cap")
  echo "=== $name: ${s}s of $(left)s left"
  if ((s < 20)); then
    echo "=== $name: not run (deadline)"
    return 124
  fi
  timeout "$s" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "=== $name: rc $rc"
  grep -E "^(hopper|ragged-breakdown|attention-breakdown|  .* us  |FAILED|ERROR)|passed|failed" "$out/$name.log" |
    tail -60
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -m pip install --no-build-isolation --no-deps -q -e . >"$out/install.log" 2>&1 ||
  for pkg in kernels primitives batching_rules; do ln -sfn "../$pkg" "pallax/$pkg"; done
python3 -c "import jax, pallax; print('jax', jax.__version__, jax.devices(), pallax.__file__)"

bench=(python3 -m pytest -n 0 -p no:cacheprovider -q --tb=long)
tests=(env PALLAX_TEST_PLATFORM=gpu python3 -m pytest -n 0 -p no:cacheprovider -q --tb=short
  --durations=10 -k "not mosaic_tpu")
# One step by name: its command under its cap.
run() {
  case $1 in
  # Tuned into a cache of its own: the benches time the heuristics' picks.
  # shellcheck disable=SC2086  # TUNE: the cases, words
  tune) step tune 240 env PALLAX_CACHE_DIR="$out/tune_cache" python3 bench/hopper_tune.py "$out" \
    ${TUNE:-paged ragged attention} ;;
  fused_smoke)
    if ! step fused_smoke 180 "${tests[@]}" -m "not compilers" \
      -k "fused_dq_backward and (causal or two or shared or wide)" \
      tests/primitives/test_attention_mosaic_gpu.py; then
      export PALLAX_BENCH_FUSED=0
    fi
    ;;
  attention_bench) step attention_bench 340 "${bench[@]}" bench/test_attention_hopper.py \
    --benchmark-json "$out/attention_bench.json" ;;
  attention_breakdown) step attention_breakdown 150 python3 bench/attention_breakdown.py ;;
  matmul_bench) step matmul_bench 80 "${bench[@]}" bench/test_matmul_hopper.py \
    --benchmark-json "$out/matmul_bench.json" ;;
  paged_bench) step paged_bench 70 "${bench[@]}" bench/test_paged_attention.py -k full \
    --benchmark-json "$out/paged_bench.json" ;;
  ragged_bench) step ragged_bench 90 "${bench[@]}" bench/test_ragged_paged_attention.py \
    --benchmark-json "$out/ragged_bench.json" ;;
  ragged_breakdown) step ragged_breakdown 60 python3 bench/ragged_breakdown.py ;;
  mosaic_tests) step mosaic_tests 300 "${tests[@]}" -m "not compilers" tests/test_pallas_mosaic_gpu.py \
    tests/primitives/test_attention_mosaic_gpu.py ;;
  tests) step tests 600 "${tests[@]}" tests/primitives/test_attention.py \
    tests/primitives/test_attention_features.py \
    tests/primitives/test_paged_attention.py tests/kernels/test_paged_attention.py \
    tests/primitives/test_matmul.py tests/kernels/test_matmul.py ;;
  serving_tests) step serving_tests 300 "${tests[@]}" tests/primitives/test_ragged_paged_attention.py \
    tests/primitives/test_ragged_paged_attention_mosaic_gpu.py tests/test_kv_cache.py \
    tests/primitives/test_rotary.py tests/test_serving.py ;;
  *) echo "=== $1: no such step (steps: $all)" ;;
  esac
}

for name in $steps; do
  run "$name"
done
echo "=== done, $(left)s before the deadline"
echo "=== PALLAX_BENCH_FUSED=${PALLAX_BENCH_FUSED:-1}"
