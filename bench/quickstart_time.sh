#!/usr/bin/env bash
# Time, in one run, a fresh clone's Quickstart (scripts/serve.sh, from nothing until
# /health/ready answers 200) at HEAD and at BASE (default a1a6e1d, the last commit before
# issue 23, whose serve.sh installed the whole test toolchain), then the full test install at
# HEAD (scripts/install.sh test,grpc, what scripts/test.sh installs), each in its own fresh
# clone and .venv.
#   bash bench/quickstart_time.sh             # HEAD of this checkout against BASE
#   KEEP=1 bash bench/quickstart_time.sh      # keep the clones (their .venv) and print where
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
port=${PORT:-18437}
base=${BASE:-a1a6e1d}
git clone -q "$repo" "$work/serve"
git clone -q "$repo" "$work/base" && git -C "$work/base" checkout -q "$base"
git clone -q "$repo" "$work/test"

quickstart() {  # clone dir: seconds from nothing until its server is ready
  local start server
  start=$(date +%s.%N)
  (cd "$1" && exec bash scripts/serve.sh --port "$port" >serve.log 2>&1) &
  server=$!
  until curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1; do
    if ! kill -0 "$server" 2>/dev/null; then cat "$1/serve.log" >&2; exit 1; fi
    sleep 0.2
  done
  echo "$(date +%s.%N) - $start" | bc
  kill -TERM "$server"
  wait "$server" || true
}
if curl -fs "http://127.0.0.1:$port/health/live" >/dev/null 2>&1; then
  echo "port $port already answers: stop that server or set PORT" >&2; exit 1
fi
serve_s=$(quickstart "$work/serve")
base_s=$(quickstart "$work/base")

start=$(date +%s.%N)
(cd "$work/test" && bash scripts/install.sh test,grpc)
test_s=$(echo "$(date +%s.%N) - $start" | bc)

printf 'quickstart at HEAD (serve.sh until /health/ready): %.1f s\n' "$serve_s"
printf 'quickstart at %s (the old serve.sh):           %.1f s\n' "$base" "$base_s"
printf 'full test install at HEAD (install.sh test,grpc): %.1f s\n' "$test_s"
printf 'python %s, %s CPU cores, %s\n' "$("$work/test/.venv/bin/python" -V 2>&1 | cut -d' ' -f2)" "$(nproc)" "$(date -u +%F)"
if [ -n "${KEEP:-}" ]; then echo "clones kept in $work"; else rm -rf "$work"; fi
