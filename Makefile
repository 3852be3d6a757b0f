# Every target bootstraps .venv on a fresh machine and is safe to re-run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The capital of France is
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install test generate serve clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Re-install only when the package metadata changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite at the CPU's own instruction-set level (tests/kernels covers every level in process), then
# the model, layer and engine tests again at each lower level the CPU can run (tests/lower_levels.py).
test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(BIN)/python tests/lower_levels.py $(PYTEST_ARGS)

generate: install
	$(BIN)/pagellm generate --prompt "$(PROMPT)"

# OpenAI-compatible server on 127.0.0.1:8000 (embedded model unless SERVE_ARGS has --model).
serve: install
	$(BIN)/pagellm serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
