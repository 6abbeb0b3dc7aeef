#!/usr/bin/env bash
# Install the runtime (scripts/install.sh, no extras) and start kda-serve; flags pass
# through (see kda-serve --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kda-serve "$@"
