#!/usr/bin/env bash
# Sets up the other end of flodl-hf's tested range in ./.venv-oldest: the oldest torch and transformers the tests
# pass on (flodl_hf/core/version.py's TESTED_RANGE; README, "Versions"). PyPI's torch 2.6.0 is a CUDA build (about
# 4 GB with its libraries) that runs on the CPU. .ci/run runs the tests marked range_end here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH=2.6.0
TRANSFORMERS=5.21.0
if [ ! -x .venv-oldest/bin/python ]; then
  "$PY" -m venv .venv-oldest
fi
.venv-oldest/bin/python -m pip install -q "torch==$TORCH" "transformers==$TRANSFORMERS"
.venv-oldest/bin/python -m pip install -q -e ".[test]" "torch==$TORCH" "transformers==$TRANSFORMERS"
echo "the oldest tested pair in .venv-oldest ($(.venv-oldest/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
