# The two commands of a fresh machine: `make run` (set up, run the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

# The main job on the embedded default: a supervised warm-start (cached), then every part as a
# process (buffer, embedded engine, trainer, rollout worker, eval), fully asynchronous, into runs/local.
run: $(STAMP)
	$(BIN)/slime-async train configs/local.yaml --overwrite

test: $(STAMP)
	$(BIN)/ruff check slime_async envs benchmarks tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check slime_async envs benchmarks tests

# torch first and pinned: 2.13.0 resolves to the local CPU build here, and the package's range
# admits it, so pip never replaces it with a several-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
