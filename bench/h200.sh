#!/usr/bin/env bash
# Everything the GPU machine is for, in three device calls (each at most 10 minutes; the
# caps fit the times seen on 2026-12-01/02: GPU suite ~220 s, kernels ~420 (the peers'
# warm-up alone 190 s, fla autotuning at H = 32 and 96), service ~110):
#   run(command="bash bench/h200.sh kernels:480", carry=[".whl", ".peers"])
#   run(command="bash bench/h200.sh gpu-tests:300 cuda-ipc:140 transport:150", carry=[".whl", ".srvwhl"])
#   run(command="bash bench/h200.sh kernel-sweep:540", carry=[".whl", ".peers"])
# or, when a session can afford one machine start only (it costs 2-4 minutes of the 30), one
# call for everything a change needs, the most important steps first:
#   run(command="bash bench/h200.sh gpu-tests:220 kernel-paths:80 prefix-cache:75 kernel-ab:110 latency:80",
#       carry=[".whl", ".srvwhl", ".peers"])
# .whl holds fla-core 0.6.0 and einops, .srvwhl the server's wheels at constraints.txt's
# versions (fastapi and its opentelemetry-api, starlette, pydantic, pydantic-core,
# typing-inspection, annotated-types, annotated-doc, typing-extensions, anyio, uvicorn,
# httptools, httpx, httpcore, h11, fastapi-offline, py-spy), all cp312, downloaded as
# /work/.library/device/README.md says, .peers the FlashKDA build (its README in the shared
# peers folder says how), all git-ignored. Figures land under $OUT; record them in
# bench/RESULTS.md with the commit.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .srvwhl/*.whl 2>/dev/null) || exit 1
# FLA_FLASH_KDA=0: fla-core runs its own Triton path, not FlashKDA (timed on its own)
export PYTHONPATH=/tmp/site:$PWD:$PWD/.peers FLA_FLASH_KDA=0 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
# a wheel missing from .srvwhl fails every server step and test the same way: say so at once
python3 -c "import service.cli" || { echo "the server does not import: a wheel is missing from .srvwhl"; exit 1; }
# Steps run in the order given; `name:seconds` caps one step's time (default below), so
# several steps fit one 10-minute call.
# tritonclient (the KServe tests' client) is a test dependency the image lacks and .srvwhl does
# not carry (its wheel and grpcio's are large): without it, tests/kserve (named as a path, pytest
# would load its conftest despite an --ignore) and the other files that import it are left out,
# said aloud, rather than stopping the whole collection
kserve_tests() {
    python3 -c "import tritonclient.grpc" 2>/dev/null && { echo tests/kserve; return; }
    local files; files=$(grep -rlE "^(import|from) tritonclient" tests --include="*.py" | grep -v "^tests/kserve/")
    echo "(tritonclient missing: tests/kserve and $(echo $files) left out)" >&2
    printf -- "--ignore=%s " $files
}
run_step() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $? ($name)"; tail -n 25 "$OUT/$name.log"
}
for spec in ${*:-gpu-tests kernels kernel-variants cuda-ipc transport}; do
    name=${spec%%:*}; limit=${spec#*:}; [[ $limit == "$spec" ]] && limit=540
    case $name in
    gpu-tests) run_step "$name" "$limit" python3 -m pytest -q -m gpu tests/triton tests/kernels tests/transport tests/service tests/state_store tests/reliability tests/client --ignore=tests/reliability/test_fuzz.py $(kserve_tests) ;;
    # the kernel paths' interpreter tests, compiled: on CUDA their `device` fixture is the GPU
    kernel-paths) run_step "$name" "$limit" python3 -m pytest -q tests/triton/test_triton_nonfinite.py tests/triton/test_triton_checkpoints.py tests/triton/test_triton_state_stages.py tests/triton/test_triton_vectors.py tests/triton/test_triton_extremes.py tests/triton/test_triton_intra_bounded.py ;;
    # the service's input checks, the kernels' input checks and non-finite flags, o into a given tensor, compiled
    kernel-checks) run_step "$name" "$limit" python3 -m pytest -q tests/triton/test_triton_extremes.py tests/triton/test_triton_nonfinite.py \
        tests/triton/test_triton_input_checks.py tests/triton/test_triton_o_out.py tests/service/test_transaction.py \
        tests/triton/test_triton_intra_bounded.py ;;
    # the service's GPU paths only (shared memory, staging, validation), and the POSIX shared
    # memory tests unfiltered: their server is on the GPU there
    service-tests) run_step "$name" "$limit" bash -c 'rc=0; python3 -m pytest -q -m gpu tests/transport tests/service tests/state_store || rc=1
        python3 -m pytest -q tests/transport/test_transport_shm.py || rc=1; exit $rc' ;;
    # the CUDA IPC transport's tests alone (over HTTP and the framed socket), and the prepared
    # prefills' (their server on the GPU: CUDA graphs)
    cuda-ipc-tests) run_step "$name" "$limit" python3 -m pytest -q tests/transport/test_transport_cuda_ipc.py \
        tests/transport/test_transport_prepared.py ;;
    # both of the above in one step (a session that may get one call): the shm, CUDA IPC and prepared tests unfiltered
    transport-tests) run_step "$name" "$limit" python3 -m pytest -q tests/transport/test_transport_shm.py \
        tests/transport/test_transport_cuda_ipc.py tests/transport/test_transport_prepared.py ;;
    kernels) run_step "$name" "$limit" python3 bench/kernels.py --json "$OUT/kernels.json" ;;
    # every case against FlashKDA alone (fla's autotuning warm-up, ~190 s, left out)
    kernels-flashkda) run_step "$name" "$limit" python3 bench/kernels.py --peers FlashKDA --json "$OUT/kernels_flashkda.json" ;;
    # the checkpoint tests, all of them compiled (their device fixture is the GPU) and the GPU-only ones
    checkpoint-tests) run_step "$name" "$limit" python3 -m pytest -q tests/triton/test_triton_checkpoints.py ;;
    kernel-sweep) run_step "$name" "$limit" python3 bench/kernels.py --sweep --json "$OUT/kernel_sweep.json" ;;
    # the stage-1 candidates' tests, unfiltered: on CUDA their `device` fixture is the GPU. One
    # process per file: a kernel that faults kills the CUDA context for every later test.
    kernel-variants) run_step "$name" "$limit" bash -c 'rc=0; for f in tests/triton/test_triton_fp16_solve.py tests/triton/test_triton_factored.py; do
        python3 -m pytest -q "$f" || rc=1; done; exit $rc' ;;
    cuda-ipc) run_step "$name" "$limit" python3 bench/cuda_ipc.py --cases 1x4096,8x4096 --dtypes bfloat16 --repeats 10 --json "$OUT/cuda_ipc.json" --server-log "$OUT/cuda_ipc_server.log" ;;
    transport) run_step "$name" "$limit" python3 bench/transport.py --mb 100 --repeats 3 --json-mb 20 --batch-rounds 3 ;;
    # issue 19's per-call figures: CUDA IPC and POSIX shm at 1x4096, 8x4096, 256x1 against the kernel, chunk_kda paths
    latency) run_step "$name" "$limit" python3 bench/latency.py gpu --json "$OUT/latency.json" ;;
    # the per-call figures of 1x4096 and the 256x1 decode step only (a short check of a request-path change)
    latency-short) run_step "$name" "$limit" python3 bench/latency.py gpu --cases 1x4096,256x1 --calls 200 \
        --json "$OUT/latency_short.json" ;;
    # issue 19's 8x4096 and decode rows with the inputs read in place (their best paths)
    latency-wide-zero-copy) run_step "$name" "$limit" python3 bench/latency.py gpu --calls 200 --cases 8x4096,256x1 \
        --server-arg=--cuda-ipc-zero-copy --json "$OUT/latency_wide_zero_copy.json" ;;
    # the same prefills with the inputs read in place (--cuda-ipc-zero-copy)
    latency-zero-copy) run_step "$name" "$limit" python3 bench/latency.py gpu --calls 100 --cases 1x4096,8x4096 \
        --server-arg=--cuda-ipc-zero-copy --json "$OUT/latency_zero_copy.json" ;;
    # where a call's time goes in the server: py-spy samples of kda-serve (every thread, collapsed
    # stacks) during the timed CUDA IPC calls of 1x4096 and the 256x1 decode step
    # the same for the 256x1 decode step alone, over HTTP and over the framed socket (600 calls each)
    latency-profile-decode) run_step "$name" "$limit" env PATH="/tmp/site/bin:$PATH" python3 bench/latency.py gpu \
        --cases 256x1 --calls 600 --profile "$OUT" --json "$OUT/latency_profile_decode.json" ;;
    latency-profile) run_step "$name" "$limit" env PATH="/tmp/site/bin:$PATH" python3 bench/latency.py gpu \
        --cases 1x4096,256x1 --calls 1500 --profile "$OUT" --json "$OUT/latency_profile.json" ;;
    # issue 18's candidates (--sweep) against the default and FlashKDA in one run (no fla: its warm-up is ~190 s)
    kernel-ab) run_step "$name" "$limit" python3 bench/kernels.py --sweep --peers FlashKDA \
        --variants 'previous intra' \
        --cases '8x4096 H32,256x128 H32,1x65536 H32,1x4096 H32' --json "$OUT/kernel_ab.json" ;;
    # the transactional launch's row copies and finite check against the kernel, 8x4096 H32 (goal < 3%)
    transaction) run_step "$name" "$limit" python3 bench/transaction.py ;;
    # prefix cache: checkpoints every 1024 tokens at 8x4096 H32 (goal <= 5%), 48-layer restores (docs/PREFIX_CACHE.md)
    prefix-cache) run_step "$name" "$limit" python3 bench/prefix_cache.py ;;
    # issue 21's restores alone (device and host tier, fresh rows and rows launches moved), and the pool's CUDA tests
    prefix-restores) run_step "$name" "$limit" bash -c 'python3 bench/prefix_cache.py --restores-only &&
        python3 -m pytest -q tests/state_store/test_pool_cuda.py tests/state_store/test_moved_rows_lifecycle.py' ;;
    # issue 19: chunk_kda's host time beside the prebuilt problem's, and whether small problems are host-bound
    host-path) run_step "$name" "$limit" python3 bench/host_path.py --cases 1x4096,256x1,1x256,8x512 --json "$OUT/host_path.json" ;;
    # the shared memory safety tests' GPU cases (pinned pages, a prepared prefill's graph hold, truncations)
    shm-gpu-tests) run_step "$name" "$limit" python3 -m pytest -q -m gpu tests/reliability/test_shm_safety.py ;;
    # issue 19: a prepared prefill's graph stage by stage (device time), beside the eager kernel call
    prepared-graph) run_step "$name" "$limit" python3 bench/prepared_graph.py ;;
    # the inputs' value check alone at 8x4096 and 1x4096 for launch shapes of value_extremes, against a copy
    extremes-sweep) run_step "$name" "$limit" python3 bench/prepared_graph.py --extremes --cases 8x4096,1x4096 ;;
    # issue 21's goal alone: the plain launch against the server's path, many interleaved repetitions
    prefix-cache-goal) run_step "$name" "$limit" python3 bench/prefix_cache.py --server-path-only --reps 300 ;;
    # the spare-row commit on the GPU: kernels writing other rows, the pool's moved rows, the
    # transaction, prepared graphs uploading their rows per run, the self-test's launches
    spare-rows-tests) run_step "$name" "$limit" python3 -m pytest -q tests/triton/test_triton_write_indices.py \
        tests/state_store/test_pool_cuda.py tests/service/test_transaction.py tests/service/test_prepared_rows.py \
        tests/transport/test_transport_prepared.py tests/transport/test_transport_cuda_ipc.py \
        tests/reliability/test_self_test.py ;;
    # the launch transaction's rows saved by the decode kernel (`saved_states`), compiled, and the graph and transaction tests
    decode-save-tests) run_step "$name" "$limit" python3 -m pytest -q tests/triton/test_triton_saved_states.py \
        tests/triton/test_triton_graph.py tests/service/test_transaction.py ;;
    # where a checkpointed launch's extra time sits: per-kernel device times, prebuilt problems, state-pass variants
    prefix-where) run_step "$name" "$limit" python3 bench/prefix_cache.py --where --reps 20 --trace "$OUT/traces" ;;
    # the same, checkpoints denser (every 256 and 128 tokens): where the segments' launches stop paying
    prefix-dense) run_step "$name" "$limit" bash -c 'python3 bench/prefix_cache.py --where --reps 10 --every 256 &&
        python3 bench/prefix_cache.py --where --reps 10 --every 128' ;;
    *) echo "unknown step $name (gpu-tests, kernel-paths, kernel-checks, service-tests, cuda-ipc-tests, transport-tests, kernels, kernels-flashkda, checkpoint-tests, kernel-sweep, kernel-variants, cuda-ipc, transport, latency, latency-short, latency-wide-zero-copy, latency-zero-copy, latency-profile-decode, latency-profile, kernel-ab, transaction, prefix-cache, shm-gpu-tests, prepared-graph, extremes-sweep, prefix-cache-goal, decode-save-tests, prefix-where, prefix-dense, prefix-restores)"; exit 2 ;;
    esac
done
