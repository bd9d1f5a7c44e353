#!/usr/bin/env bash
# The AMX checks in one go, for a machine whose CPU has AMX tiles but no copy of the real models
# (the GPU machine's host: no network): build the extension for the CPU, run the kernel tests
# (every ISA cap, AMX included), the bit-for-bit determinism tests and engine test modules on
# the CPU, then time forwards on 2 cores (taskset) with random weights, AMX against the AVX-512
# cap (bench/bench_gpu.py --device cpu). Logs and JSON under $OUT.
#   OUT=amx_out bash bench/amx_check.sh
set -u
OUT=${OUT:-amx_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
step() { echo "== $1 ($(date +%T))"; }
step env
{ lscpu | grep -E "Model name|^CPU\(s\)"; lscpu | grep -o -E "amx_bf16|amx_tile|avx512_bf16" | sort -u | tr '\n' ' '
  python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
step build
SPECENGINE_NO_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} timeout 300 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import specengine.ops.kernels as k; print('amx', k.amx_available(), 'isa', k.active_isa())" | tee -a "$OUT/env.txt"
step test_kernels
timeout ${KERNEL_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py 2>&1 | tail -8 | tee "$OUT/test_kernels.txt"
step test_determinism
timeout ${DET_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_determinism.py -k "not server" 2>&1 \
  | tail -20 | tee "$OUT/test_determinism.txt"
step engine_tests
# engine test modules (tiny random models; integration tests need the real model's package)
timeout ${ENGINE_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m "not integration" -rf --tb=line \
  $(for m in ${ENGINE_TESTS:-engine spec_engine eagle prefix_cache}; do echo tests/test_$m.py; done) 2>&1 \
  | tail -15 | tee "$OUT/engine_tests.txt"
step bench
for isa in ${ISAS:-amx avx512}; do
  SPECENGINE_ISA=$isa PYTHONPATH=$PWD timeout ${BENCH_TIMEOUT:-150} taskset -c 0,1 python3 bench/bench_gpu.py --device cpu \
    --threads 2 --models ${MODELS:-smollm2-135m} --ts ${TS:-1,2,4,8,16,32,64,128} --batches ${BATCHES:-1,8,32,64} \
    --repeats ${REPEATS:-5} --out "$OUT/forward_$isa.json" > "$OUT/forward_$isa.txt" 2>&1
  echo "-- $isa"; cat "$OUT/forward_$isa.txt" | cut -c1-200 | tail -20
done
step done
