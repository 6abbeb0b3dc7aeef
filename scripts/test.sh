#!/usr/bin/env bash
# Install with the test tools and the grpc extra (scripts/install.sh test,grpc) and run the
# whole test suite. GPU-marked tests run only where CUDA exists; on the CPU the Triton
# kernels run under the Triton interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,grpc  # grpc: the KServe v2 gRPC endpoint (--grpc-port)
exec .venv/bin/python -m pytest -q "$@"
