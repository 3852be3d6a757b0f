# Every target bootstraps .venv on a fresh machine and is safe to re-run.
# The venv's interpreter: python3, or another one here that imports faster (tools/pick_python.py says why).
PYTHON ?= $(shell python3 tools/pick_python.py || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The capital of France is
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install test generate serve clean chromium peers

# Without an NVIDIA GPU, torch comes from PyTorch's CPU-only index when that is reachable: the same library
# without the CUDA libraries PyPI's x86-64 build links (~3 GB of nvidia-* wheels, ~240 MB resident in every
# process: docs/benchmarks/2026-11-24-where-the-memory-goes.md). Otherwise, or with a GPU, PyPI's build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; then :; \
	elif $(BIN)/pip install --quiet --timeout 15 --retries 1 --index-url $(TORCH_CPU_INDEX) 'torch>=2.4' 2>/dev/null; \
	then echo "make: torch installed from $(TORCH_CPU_INDEX) (CPU-only build)"; \
	else echo "make: $(TORCH_CPU_INDEX) not reachable: torch will come from PyPI (its build links CUDA libraries)"; fi

# Re-install only when the package metadata changes. The native kernels are compiled here, for every
# instruction-set level this CPU runs and side by side, so that no start (nor the suite) waits for a compiler;
# an edited kernel is rebuilt on its first use.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m pagellm.kernels pagellm/loader/csrc/sentencepiece_vocab.cpp
	touch $(STAMP)

# Bytecode for pagellm's own modules, refreshed when a source changes: an editable install gets none from pip,
# and where PYTHONDONTWRITEBYTECODE is set (common in containers) Python would otherwise compile every module at
# every start (measured: docs/PERFORMANCE.md, "Bytecode for pagellm's modules").
BYTECODE := $(VENV)/.bytecode
$(BYTECODE): $(STAMP) $(shell find pagellm -name '*.py')
	$(BIN)/python -m compileall -q pagellm
	touch $(BYTECODE)

install: $(STAMP) $(BYTECODE)

# The chat page's browser test drives Debian's Chromium; installed here when missing and possible (root or
# password-less sudo), else that one test is skipped and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { APT="apt-get"; [ "$$(id -u)" = 0 ] || APT="sudo -n apt-get"; \
		( DEBIAN_FRONTEND=noninteractive $$APT install -y -q chromium >/dev/null 2>&1 || \
		  ( $$APT update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $$APT install -y -q chromium >/dev/null 2>&1 ) ) \
		|| echo "make: could not install chromium; the chat page test will be skipped"; }

# The whole suite at the CPU's own instruction-set level (tests/kernels covers every level in process), then
# the model, layer and engine tests again at each lower level the CPU can run, and the HF-parity and engine
# tests once with native kernels off (tests/lower_levels.py).
# The main pass on TEST_WORKERS pytest-xdist workers, a test file each at a time, with OpenMP's threads asleep
# while they wait (OMP_WAIT_POLICY=passive): on our 2-core hosts one process kept the cores about half busy (model
# loads, servers, the Triton interpreter), and two processes whose thread pools spin at their barriers took twice
# the CPU for the same tests (docs/benchmarks/2026-11-24-test-suite.md). tests/lower_levels.py runs its level
# passes the same way. Each worker builds its own fixtures; TEST_WORKERS=0: one process (e.g. for --pdb).
# PYTHONDONTWRITEBYTECODE is lifted for the tests: pytest rewrites every test module's asserts at each start unless
# it may cache the result beside the module, which that variable forbids (about half of each process's collection).
TEST_WORKERS ?= 2
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
test: install chromium
	$(TEST_ENV) OMP_WAIT_POLICY=passive $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 \
		$(PYTEST_ARGS)
	$(TEST_ENV) $(BIN)/python tests/lower_levels.py --workers=$(TEST_WORKERS) $(PYTEST_ARGS)

generate: install
	$(BIN)/pagellm generate --prompt "$(PROMPT)"

# OpenAI-compatible server on 127.0.0.1:8000 (embedded model unless SERVE_ARGS has --model).
serve: install
	$(BIN)/pagellm serve $(SERVE_ARGS)

# The peers of `pagellm bench`: llama.cpp's own tools (llama-server, llama-batched-bench, ...) compiled once from the
# llama.cpp of a pinned llama-cpp-python release and cached under ~/.cache/llama-cpp-peer, that llama-cpp-python in
# .venv on the same build (no second compile), and matplotlib for --plot (how: tools/build-llama-cpp.sh; how long:
# the README). Without them those commands measure pagellm alone and say so; a second run finds all cached.
peers: install
	$(BIN)/pip install --quiet matplotlib
	tools/build-llama-cpp.sh --python $(BIN)/python

clean:
	rm -rf $(VENV) build *.egg-info
