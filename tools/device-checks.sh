#!/usr/bin/env bash
# The GPU checks of issues 53 and 54 in one run, each step under its own time limit so one that hangs leaves the
# others their time: GGUF blocks on the GPU (bench device-gguf) and the hybrid models (bench device-check).
#
#   tools/device-checks.sh cuda OUT_DIR      on a device machine (rows as JSON under OUT_DIR)
#   tools/device-checks.sh cpu OUT_DIR       the rehearsal here, at tiny shapes
#
# Next, when the budget allows (each server start loads the model again): the original documents' serving run,
#   python3 -m pagellm bench device-check --device cuda --shapes qwen3.5-35b-a3b --npl 1 --peers none \
#     --serve-prompts 128 --serve-shape qwen3.5-35b-a3b --serve-shared-prefix 1000 --serve-max-seqs 128 \
#     --serve-rounds 5       (a soak: memory after each round, then a too-long prompt must be a 400)
#
# Before a device run, on the host: the wheels its image lacks and a sample of real GGUF tensors, both carried
# (ignored paths):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl gguf llguidance
#   .venv/bin/python -m pagellm bench device-gguf --write-sample .whl/sample.gguf
#   tools/llama-cpp-cuda.sh pack        (llama.cpp's sources, for its CUDA build there: the GGUF check's peer)
set -uo pipefail
DEVICE=${1:?cuda or cpu}
OUT=${2:?an output folder}
mkdir -p "$OUT"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -d .whl ] && ! $PY -c "import gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
SAMPLE=()
if [ -f .whl/sample.gguf ]; then SAMPLE=(--sample .whl/sample.gguf); fi
status=0
run() {  # run LIMIT_SECONDS NAME COMMAND...: one step, its output kept
  local limit=$1 name=$2
  shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   $name failed: rc=$?"; status=1; }
  tail -n 20 "$OUT/$name.log"
}
if [ "$DEVICE" = cuda ]; then
  PEER=()
  if [ -f .whl/llama-src.tgz ]; then  # llama.cpp's CUDA build on the CPUs while the hybrid check has the GPU
    (timeout 480 tools/llama-cpp-cuda.sh build > "$OUT/llama-build.out" 2> "$OUT/llama-build.log") &
    BUILD=$!
  fi
  run 240 hybrid-35b-a3b $PY -m pagellm bench device-check --device cuda --shapes qwen3.5-35b-a3b \
    --npl 1,8,32,64,128 --pp 128 --tg 128 --peers none --serve-prompts 0 --out "$OUT/hybrid-35b-a3b.json"
  if [ -n "${BUILD:-}" ] && wait "$BUILD" && [ -x "$(tail -n 1 "$OUT/llama-build.out")" ]; then
    PEER=(--llama-batched-bench "$(tail -n 1 "$OUT/llama-build.out")")
  elif [ -n "${BUILD:-}" ]; then
    echo "   llama.cpp's CUDA build did not finish: $OUT/llama-build.log"
  fi
  run 300 gguf-1b $PY -m pagellm bench device-gguf --device cuda --shape 1b "${SAMPLE[@]}" "${PEER[@]}" \
    --out "$OUT/gguf-1b.json"
  # next when the budget allows: the 35B-A3B file in Q4_K_M blocks (21 GB written on the device) against
  # llama.cpp, issue 54's headline: device-gguf --shape qwen3.5-35b-a3b --npl 1,8,32 --pp 128 --tg 128
else
  export TRITON_INTERPRET=1  # the GGUF numerics run the Triton kernels under the interpreter here
  run 300 gguf-tiny $PY -m pagellm bench device-gguf --device cpu --shape tiny --npl 1,2 --pp 16 --tg 4 \
    "${SAMPLE[@]}" --out "$OUT/gguf-tiny.json"
  unset TRITON_INTERPRET
  run 240 hybrid-tiny $PY -m pagellm bench device-check --device cpu --shapes tiny-hybrid --npl 1,2 --pp 16 \
    --tg 4 --peers none --out "$OUT/hybrid-tiny.json"
fi
exit $status
