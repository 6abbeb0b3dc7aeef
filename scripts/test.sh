#!/usr/bin/env bash
# Install (scripts/install.sh) and run the whole test suite. GPU-marked tests run only
# where CUDA exists; on the CPU the Triton kernels run under the Triton interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
