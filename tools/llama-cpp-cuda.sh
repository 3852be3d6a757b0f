#!/usr/bin/env bash
# llama.cpp's own CUDA build on a device machine, as the GGUF check's peer (bench device-gguf
# --llama-batched-bench). The device has nvcc, CMake and ninja but no network, so its sources travel: the parts
# of the llama.cpp tree that the llama-cpp-python sdist carries (vendor/llama.cpp, the version
# ../shared/peers/build-llama-cpp.sh builds for CPUs) that its CMake build reads, about 9 MB packed.
#
#   tools/llama-cpp-cuda.sh pack [SDIST_DIR]    on the host: .whl/llama-src.tgz (carried with .whl)
#   tools/llama-cpp-cuda.sh build               on the device: builds for sm_90 only, prints the binary's path
set -euo pipefail
case "${1:?pack or build}" in
  pack)
    src=${2:-$HOME/.cache/llama-cpp-peer/llama_cpp_python-0.3.36/vendor/llama.cpp}
    [ -f "$src/CMakeLists.txt" ] || { echo "no llama.cpp sources at $src (../shared/peers/build-llama-cpp.sh unpacks them)" >&2; exit 2; }
    mkdir -p .whl
    tar czf .whl/llama-src.tgz -C "$src" ggml src include common tools vendor app licenses \
      cmake CMakeLists.txt
    echo ".whl/llama-src.tgz ($(du -h .whl/llama-src.tgz | cut -f1))"
    ;;
  build)
    dir=/tmp/llama-cuda
    mkdir -p "$dir/src" && tar xzf .whl/llama-src.tgz -C "$dir/src"
    cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >&2
    cmake --build "$dir/build" -j"$(nproc)" --target llama-batched-bench >&2
    echo "$dir/build/bin/llama-batched-bench"
    ;;
  *) echo "pack or build" >&2; exit 2 ;;
esac
