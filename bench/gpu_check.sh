#!/usr/bin/env bash
# The GPU checks in one go, for a CUDA machine with torch, triton and nvcc (no network): build
# the extension with its CUDA kernels, run the CUDA tests, the Triton kernel compiled for the
# GPU, the bit-for-bit determinism tests on the GPU, then bench/bench_gpu.py. Logs under $OUT.
#   OUT=gpu_out bash bench/gpu_check.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
step() { echo "== $1 ($(date +%T))"; }
step env
{ nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)"; lscpu | grep -o -E "amx_bf16|avx512_bf16" | sort -u | tr '\n' ' '
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
step build
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} timeout 300 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import specengine._C as c; print('with_cuda', c.with_cuda)" || exit 1
step test_cuda
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25 | tee "$OUT/test_cuda.txt"
step test_triton
TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton.py 2>&1 | tail -12 | tee "$OUT/test_triton.txt"
step test_determinism
SPECENGINE_TEST_DEVICE=cuda timeout ${DET_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_determinism.py \
  -k "not server" 2>&1 | tail -40 | tee "$OUT/test_determinism.txt"
step bench
PYTHONPATH=$PWD timeout ${BENCH_TIMEOUT:-120} python3 bench/bench_gpu.py --repeats 10 --profile \
  --out "$OUT/bench_gpu.json" > "$OUT/bench_gpu.txt" 2>&1; grep -v "^ *$" "$OUT/bench_gpu.txt" | cut -c1-150 | tail -70
step engine_tests
# the engine's own tests, one module at a time (a crash loses one): LLM(device="auto") runs them
# on the GPU here. Deselected: test_feature_store_write_in_one_call_equals_torch_indexing, a CPU
# test whose ValueError raised inside the extension segfaulted under that image's torch 2.11
# (cause not established; it passes with torch 2.13).
for m in ${ENGINE_TESTS:-engine spec_engine eagle merged prefix_cache penalties rollout}; do
  echo "== $m" >> "$OUT/engine_tests.txt"
  timeout ${MODULE_TIMEOUT:-40} python3 -m pytest -q -p no:cacheprovider -m "not integration" -rf \
    --tb=line --deselect \
    tests/test_prefix_cache.py::test_feature_store_write_in_one_call_equals_torch_indexing \
    "tests/test_$m.py" >> "$OUT/engine_tests.txt" 2>&1
done
grep -E "^== |^FAILED|^ERROR|passed|failed|Fatal" "$OUT/engine_tests.txt" | cut -c1-200
step done
