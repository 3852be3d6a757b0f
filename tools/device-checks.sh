#!/usr/bin/env bash
# The GPU checks of issues 53 and 54 as two device calls, each step under its own time limit so one that hangs
# leaves the others their time, and every step's rows written as it ends:
#
#   tools/device-checks.sh cuda OUT_DIR        first call: the Triton kernels' tests on the GPU, the 8B GGUF in
#                                              blocks against bf16, the 35B-A3B hybrid in bf16 (graphs, eager), the
#                                              Gated DeltaNet prefill rule (Triton, torch, fla-core)
#   tools/device-checks.sh cuda-more OUT_DIR   second call, on the same warm machine if the budget still allows
#                                              one (the first call and the start take most of 15 minutes): a
#                                              verify step against a decode step (8B), llama.cpp's CUDA build (its
#                                              compile starts in the first call) on the 8B file, the grouped MoE
#                                              launches' tiles at 35B-A3B (kernels/gpu/moe_tiles.json's entries),
#                                              the 35B-A3B's rows with its recurrent state in bf16, and the
#                                              35B-A3B file in Q4_K_M blocks against llama.cpp
#   tools/device-checks.sh cpu OUT_DIR         the rehearsal here, at tiny shapes
#
# Next, when the budget allows (each server start loads the model again): the original documents' serving run,
#   python3 -m pagellm bench device-check --device cuda --shapes qwen3.5-35b-a3b --npl 1 --peers none \
#     --modes graphs-async --skip-checks --serve-prompts 128 --serve-shape qwen3.5-35b-a3b \
#     --serve-shared-prefix 1000 --serve-max-seqs 128 --serve-rounds 5   (a soak; then a too-long prompt: a 400)
# and the MTP head's bound and cost (a head made to predict the model, then the random one; each run a new engine):
#   python3 -m pagellm bench mtp --device cuda --shape qwen3.5-35b-a3b --npl 1,8 --pp 128 --tg 128 --k 1,3 \
#     --rounds 1 --kv-cache-memory 8 --out OUT/mtp-35b-a3b.json
#
# Before a device run, on the host: the wheels its image lacks, a sample of real GGUF tensors, llama.cpp's
# sources and the commit's name, all carried in .whl (an ignored path; the tree travels without .git):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl gguf llguidance          (the versions .venv holds; docs/benchmarks name the whole list)
#   python3 -m pip download --no-deps -d .whl fla-core==0.6.0 einops    (the prefill rule's peer)
#   .venv/bin/python -m pagellm bench device-gguf --write-sample .whl/sample.gguf
#   tools/llama-cpp-cuda.sh pack
#   git rev-parse --short HEAD > .whl/commit
set -uo pipefail
DEVICE=${1:?cuda, cuda-more or cpu}
OUT=${2:?an output folder}
mkdir -p "$OUT"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -d .whl ] && ! $PY -c "import gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
SAMPLE=()
if [ -f .whl/sample.gguf ]; then SAMPLE=(--sample .whl/sample.gguf); fi
COMMIT=(--commit "$(cat .whl/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)")
status=0
run() {  # run LIMIT_SECONDS NAME COMMAND...: one step, its output kept
  local limit=$1 name=$2
  shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   $name failed: rc=$?"; status=1; }
  tail -n 12 "$OUT/$name.log"
}
HYBRID=(bench device-check --device cuda --shapes qwen3.5-35b-a3b --pp 128 --tg 128 --peers none --serve-prompts 0
        --skip-checks)
LLAMA_BIN=/tmp/llama-cuda/build/bin/llama-batched-bench
case "$DEVICE" in
  cuda)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch; from pagellm.bench import roofline; \
print('copy bandwidth GB/s (read):', roofline.measure_read_bandwidth(4 << 30, device='cuda') / 1e9)"
    if [ -f .whl/llama-src.tgz ]; then  # compiles on the CPUs, at low priority, into the second call
      setsid nohup nice -n 19 tools/llama-cpp-cuda.sh build > /tmp/llama-build.out 2> /tmp/llama-build.log &
    fi
    XDIST=()
    if $PY -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi  # the kernels compile on 8 of the 16 cores
    run 80 pytest-gpu $PY -m pytest tests/gpu tests/runner/test_sampler.py -q -p no:cacheprovider "${XDIST[@]}"
    run 200 gguf-8b $PY -m pagellm bench device-gguf --device cuda --shape 8b --npl 1,16,64 --pp 512 --tg 64 \
      "${SAMPLE[@]}" "${COMMIT[@]}" --file /tmp/llama-8b-q4_k_m.gguf --out "$OUT/gguf-8b.json"
    run 100 hybrid-graphs $PY -m pagellm "${HYBRID[@]}" --modes graphs-async --npl 1,8,32,64,128 \
      --out "$OUT/hybrid-graphs.json"
    run 70 hybrid-eager $PY -m pagellm "${HYBRID[@]}" --modes eager --npl 8,64,128 --out "$OUT/hybrid-eager.json"
    run 90 delta-prefill $PY -m pagellm bench device-check --device cuda --shapes "" --skip-checks --serve-prompts 0 \
      --peers none --delta-prefill-shape qwen3.5-35b-a3b --out "$OUT/delta-prefill.json"
    tail -n 3 /tmp/llama-build.log 2>/dev/null
    ;;
  cuda-more)
    run 60 verify-8b $PY -m pagellm bench device-check --device cuda --shapes "" --skip-checks --serve-prompts 0 \
      --verify-shape 8b --out "$OUT/verify-8b.json"
    for _ in $(seq 20); do [ -x "$LLAMA_BIN" ] && break; sleep 1; done
    PEER=()
    if [ -x "$LLAMA_BIN" ]; then PEER=(--llama-batched-bench "$LLAMA_BIN"); else
      echo "llama.cpp's CUDA build is not there:"; tail -n 5 /tmp/llama-build.log 2>/dev/null; fi
    if [ -x "$LLAMA_BIN" ] && [ -f /tmp/llama-8b-q4_k_m.gguf ]; then
      run 60 gguf-8b-llama $PY -m pagellm bench device-gguf --device cuda --shape 8b --npl 1,16,64 --pp 512 \
        --tg 64 --skip-checks --engines llama.cpp "${PEER[@]}" "${COMMIT[@]}" --file /tmp/llama-8b-q4_k_m.gguf \
        --out "$OUT/gguf-8b-llama.json"
    fi
    run 150 moe-tiles $PY -m pagellm bench device-check --device cuda --shapes "" --skip-checks --serve-prompts 0 \
      --peers none --moe-tiles-shape qwen3.5-35b-a3b --out "$OUT/moe-tiles.json"   # entries for moe_tiles.json
    run 60 hybrid-bf16-state $PY -m pagellm "${HYBRID[@]}" --modes graphs-async --npl 1,64,128 \
      --mamba-ssm-cache-dtype bfloat16 --out "$OUT/hybrid-bf16-state.json"   # against hybrid-graphs' fp32 rows
    run 200 gguf-35b-a3b $PY -m pagellm bench device-gguf --device cuda --shape qwen3.5-35b-a3b --npl 1,8,32 \
      --pp 128 --tg 128 --skip-checks --engines pagellm-gguf,llama.cpp "${PEER[@]}" "${COMMIT[@]}" \
      --file /tmp/qwen3.5-35b-a3b-q4_k_m.gguf --out "$OUT/gguf-35b-a3b.json"
    ;;
  cpu)
    export TRITON_INTERPRET=1  # the GGUF numerics run the Triton kernels under the interpreter here
    run 300 gguf-tiny $PY -m pagellm bench device-gguf --device cpu --shape tiny --npl 1,2 --pp 16 --tg 4 \
      "${SAMPLE[@]}" "${COMMIT[@]}" --file "$OUT/tiny.gguf" --out "$OUT/gguf-tiny.json"
    run 120 gguf-tiny-again $PY -m pagellm bench device-gguf --device cpu --shape tiny --npl 1 --pp 16 --tg 4 \
      --skip-checks --engines pagellm-gguf "${COMMIT[@]}" --file "$OUT/tiny.gguf" --out "$OUT/gguf-tiny-again.json"
    unset TRITON_INTERPRET
    run 240 hybrid-tiny $PY -m pagellm bench device-check --device cpu --shapes tiny-hybrid --npl 1,2 --pp 16 \
      --tg 4 --peers none --modes async --out "$OUT/hybrid-tiny.json"
    run 60 delta-prefill-tiny env TRITON_INTERPRET=1 $PY -m pagellm bench device-check --device cpu --shapes "" \
      --skip-checks --serve-prompts 0 --peers none --delta-prefill-shape tiny-hybrid --out "$OUT/delta-tiny.json"
    run 120 verify-tiny $PY -m pagellm bench device-check --device cpu --shapes "" --skip-checks --serve-prompts 0 \
      --verify-shape tiny --out "$OUT/verify-tiny.json"
    run 240 hybrid-tiny-eager $PY -m pagellm bench device-check --device cpu --shapes tiny-hybrid --npl 1,2 \
      --pp 16 --tg 4 --peers none --modes eager --skip-checks --out "$OUT/hybrid-tiny-eager.json"
    ;;
  *) echo "cuda, cuda-more or cpu" >&2; exit 2 ;;
esac
exit $status
