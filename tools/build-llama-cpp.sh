#!/usr/bin/env bash
# llama.cpp, the peer `pagellm bench` measures pagellm beside, built once from source and cached:
#   - its own tools: llama-server (bench serve-compare), llama-batched-bench, llama-bench, llama-perplexity;
#   - with --python PY: llama-cpp-python in PY's environment (bench compare, bench accuracy), its Python
#     package only, reading the libraries of that same build. llama.cpp thus compiles once, not twice, and the
#     in-process peer and the tools are one llama.cpp.
# The sources are those the pinned llama-cpp-python release vendors (vendor/llama.cpp of its sdist), built for this
# CPU only. Nothing is fetched but from the package registry, through pip, and only what the cache lacks.
#
# Usage: tools/build-llama-cpp.sh [--python PY] [--dry-run] [PREFIX]
#   PREFIX      the cache; default $PAGELLM_PEERS_DIR, else ${XDG_CACHE_HOME:-~/.cache}/llama-cpp-peer
#               (pagellm/bench/peer_setup.py looks there for the tools)
#   --dry-run   say what would run and what the cache already holds; run nothing
# Prints the folder of the tools on stdout (all else goes to stderr), e.g.
#   "$(tools/build-llama-cpp.sh)/llama-server" -m model.gguf --port 8081
# The compile is the long part (the README says how long); with the cache filled every step is skipped.
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python's release: the package installed, and the llama.cpp its sdist vendors
TOOLS=(llama-server llama-batched-bench llama-bench llama-perplexity)

PY="" DRY=0 PREFIX="" FETCHED=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build-llama-cpp.sh: unknown option $1" >&2; exit 2 ;;
    *) PREFIX=$1; shift ;;
  esac
done
PREFIX=${PREFIX:-${PAGELLM_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cpp-peer}}
BIN="$PREFIX/build/bin"
SDIST="$PREFIX/llama_cpp_python-$VERSION.tar.gz"
SRC="$PREFIX/llama_cpp_python-$VERSION"
WHEELS="$PREFIX/wheels"
PIP_PY=${PY:-python3}

say() { echo "build-llama-cpp.sh: $*" >&2; }
step() {  # run a command, or under --dry-run only show it
  if [ "$DRY" = 1 ]; then say "would run: $*"; else "$@" >&2; fi
}

# On a CPU with AMX, llama.cpp is built without its AMX path: this release runs tile instructions on worker threads
# that never asked the kernel for the tile state, which dies with SIGILL (seen on an Intel Xeon VM where AMX itself
# works; llama.cpp's pull request 26954, open). Its AVX-512 VNNI path and weight repacking stay: the peer it ships.
# GCC keeps an explicit -mno-* whatever -march=native says, in any order.
EXTRA_FLAGS=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
STAMP="$PREFIX/build/pagellm-extra-flags"  # the flags the cached build was made with: another set rebuilds

tools_built() {
  local tool
  for tool in "${TOOLS[@]}"; do [ -x "$BIN/$tool" ] || return 1; done
  [ "$(cat "$STAMP" 2>/dev/null || true)" = "$EXTRA_FLAGS" ]
}

fetch_sources() {
  if [ -f "$SDIST" ]; then say "cached: $SDIST"; else
    step mkdir -p "$PREFIX"
    step "$PIP_PY" -m pip download -q --no-deps --no-binary :all: -d "$PREFIX" "llama-cpp-python==$VERSION"
  fi
  if [ -d "$SRC/vendor/llama.cpp" ]; then say "cached: $SRC"; else step tar xzf "$SDIST" -C "$PREFIX"; fi
  FETCHED=1
}

build_tools() {
  if tools_built; then say "cached: ${TOOLS[*]} in $BIN"; return; fi
  fetch_sources
  say "building llama.cpp (llama-cpp-python $VERSION's) in $PREFIX/build: 5-15 minutes on 2 cores, once"
  # Shared libraries: the Python package loads them. CUDA off: the peer runs on the CPU (tools/llama-cpp-cuda.sh
  # is the GPU build). No curl: models are local files.
  step cmake -S "$SRC/vendor/llama.cpp" -B "$PREFIX/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS="$EXTRA_FLAGS ${CFLAGS:-}" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS ${CXXFLAGS:-}"
  step cmake --build "$PREFIX/build" -j"$(nproc)" --target "${TOOLS[@]}"
  if [ "$DRY" = 0 ]; then echo "$EXTRA_FLAGS" > "$STAMP"; fi
}

python_package_ready() {
  "$PY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null
}

install_python_package() {
  if python_package_ready; then say "cached: llama-cpp-python $VERSION in $PY's environment"; return; fi
  local wheel
  wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then say "cached: $wheel"; else
    [ -f "$SDIST" ] || [ "$FETCHED" = 1 ] || fetch_sources
    # LLAMA_BUILD=OFF: the package without its own copy of llama.cpp, so building the wheel compiles nothing
    step env CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$SDIST"
    wheel="$WHEELS/llama_cpp_python-$VERSION-(built).whl"
    [ "$DRY" = 1 ] || wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
  fi
  if "$PY" -m pip show -q llama-cpp-python >/dev/null 2>&1; then  # another build of it, or one without libraries
    step "$PY" -m pip uninstall -q -y llama-cpp-python
  fi
  step "$PY" -m pip install -q "$wheel"
  link_libraries
}

link_libraries() {
  # The package loads llama.cpp from its lib folder: that folder is the build's. A link, not copies: the
  # libraries find each other by the build folder's path, and the process then holds one copy of each.
  if [ "$DRY" = 1 ]; then say "would link: <llama_cpp package>/lib -> $BIN"; return; fi
  local package
  package=$("$PY" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))")
  [ -f "$package/llama_cpp.py" ] || { say "llama_cpp is not installed in $PY's environment"; exit 1; }
  if [ -L "$package/lib" ]; then rm "$package/lib"; elif [ -d "$package/lib" ]; then rm -r "$package/lib"; fi
  ln -s "$BIN" "$package/lib"
  python_package_ready || { say "llama_cpp does not import from $PY after the install"; exit 1; }
  say "installed: llama-cpp-python $VERSION in $PY's environment, on $BIN"
}

build_tools
if [ -n "$PY" ]; then install_python_package; fi
echo "$BIN"
