#!/usr/bin/env bash
# Create .venv (if missing) and install kda-serve into it, editable, with the extras named
# in the first argument (comma-separated: `bash scripts/install.sh test,grpc`; none: the
# runtime only, what scripts/serve.sh needs).
# torch: a CUDA build where an NVIDIA driver is present, else the CPU build pinned below
# (on the project's CI machines `torch==2.13.0` resolves to a local CPU wheel; an
# unpinned torch would pull a multi-GB CUDA build). Override with KDA_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "${KDA_TORCH_SPEC:-}" ]; then
  torch_spec=$KDA_TORCH_SPEC
elif command -v nvidia-smi >/dev/null 2>&1; then
  torch_spec="torch>=2.4"
else
  torch_spec="torch==2.13.0"
fi
# --no-compile: no byte-compiling of every installed module up front (torch's alone took 19 of
# its 28 s on a 2-core machine); Python compiles the modules it imports, once, on first import
.venv/bin/python -m pip install -q --no-compile "$torch_spec"
.venv/bin/python -m pip install -q --no-compile -e ".${extras:+[$extras]}"
