#!/usr/bin/env bash
# Everything the GPU machine is for, in four device calls (each at most 10 minutes):
#   run(command="bash bench/h200.sh gpu-tests kernel-variants", carry=[".whl", ".srvwhl"])
#   run(command="bash bench/h200.sh kernels", carry=[".whl", ".srvwhl"])
#   run(command="bash bench/h200.sh cuda-ipc", carry=[".whl", ".srvwhl"])
#   run(command="bash bench/h200.sh transport", carry=[".whl", ".srvwhl"])
# .whl holds fla-core 0.6.0 and einops, .srvwhl the server's wheels (fastapi, starlette,
# pydantic, pydantic-core, uvicorn, httptools, ...), all cp312, downloaded as
# /work/.library/device/README.md says (git-ignored). Figures land under $OUT; record them in
# bench/RESULTS.md with the commit.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .srvwhl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLA_FLASH_KDA=0 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
wanted=" ${*:-gpu-tests kernels kernel-variants cuda-ipc transport} "
step() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    [[ $wanted == *" $name "* ]] || return 0
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $? ($name)"; tail -n 25 "$OUT/$name.log"
}
step gpu-tests 300 python3 -m pytest -q -m gpu tests/triton tests/kernels tests/transport tests/service tests/state_store
step kernels 540 python3 bench/kernels.py --sweep --json "$OUT/kernels.json"
# the stage-1 candidates' tests, unfiltered: on CUDA their `device` fixture is the GPU. One
# process per file: a kernel that faults kills the CUDA context for every later test.
step kernel-variants 240 bash -c 'rc=0; for f in tests/triton/test_triton_fp16_solve.py tests/triton/test_triton_factored.py; do
    python3 -m pytest -q "$f" || rc=1; done; exit $rc'
step cuda-ipc 540 python3 bench/cuda_ipc.py --cases 1x4096,8x4096 --dtypes bfloat16 --repeats 10 --json "$OUT/cuda_ipc.json" --server-log "$OUT/cuda_ipc_server.log"
step transport 540 python3 bench/transport.py --mb 100 --repeats 3 --json-mb 20 --batch-rounds 3
