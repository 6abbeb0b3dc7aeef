#!/usr/bin/env bash
# Create .venv (if missing) and install kda-serve with its test tools and the grpc extra into it.
# torch: a CUDA build where an NVIDIA driver is present, else the CPU build pinned below
# (on the project's CI machines `torch==2.13.0` resolves to a local CPU wheel; an
# unpinned torch would pull a multi-GB CUDA build). Override with KDA_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
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
.venv/bin/python -m pip install -q "$torch_spec"
.venv/bin/python -m pip install -q -e ".[test,grpc]"  # grpc: the KServe v2 gRPC endpoint (--grpc-port)
