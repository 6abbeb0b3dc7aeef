#!/usr/bin/env bash
# Time, in one run, a fresh clone's Quickstart (scripts/serve.sh, from nothing until
# /health/ready answers 200) against the full test install (scripts/install.sh test,grpc,
# what scripts/test.sh installs before running pytest), each in its own fresh clone and .venv.
#   bash bench/quickstart_time.sh             # clones HEAD of this checkout
#   KEEP=1 bash bench/quickstart_time.sh      # keep the clones (their .venv) and print where
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
port=${PORT:-18437}
git clone -q "$repo" "$work/serve"
git clone -q "$repo" "$work/test"

start=$(date +%s.%N)
(cd "$work/serve" && exec bash scripts/serve.sh --port "$port" >serve.log 2>&1) &
server=$!
until curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1; do
  if ! kill -0 "$server" 2>/dev/null; then cat "$work/serve/serve.log"; exit 1; fi
  sleep 0.2
done
serve_s=$(echo "$(date +%s.%N) - $start" | bc)
kill -TERM "$server"
wait "$server" || true

start=$(date +%s.%N)
(cd "$work/test" && bash scripts/install.sh test,grpc)
test_s=$(echo "$(date +%s.%N) - $start" | bc)

printf 'quickstart (serve.sh until /health/ready): %.1f s\n' "$serve_s"
printf 'full test install (install.sh test,grpc):  %.1f s\n' "$test_s"
printf 'python %s, %s CPU cores, %s\n' "$("$work/test/.venv/bin/python" -V 2>&1 | cut -d' ' -f2)" "$(nproc)" "$(date -u +%F)"
if [ -n "${KEEP:-}" ]; then echo "clones kept in $work"; else rm -rf "$work"; fi
