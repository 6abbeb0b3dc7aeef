"""Bytes each Triton stage moves through device memory, as written (each tensor a stage
reads or writes counted once: re-reads the L2 catches, such as the second V block's read of
the same q, k, g, are not counted). For `bench/kernels.py`: bytes over a stage's measured
time is its achieved bandwidth, against the ~4.3 TB/s copy ceiling of an H200.

Sizes follow `kernels.triton_backend.run_triton` for 16-bit inputs (operand tiles fp16,
T diag(beta) fp16 with the bounded-entry solve, u fp32) or fp32 inputs (all fp32).
"""
from __future__ import annotations

CHUNK = 64


def stage_bytes(lengths: list[int], H: int, HV: int, K: int, V: int, in_bytes: int,
                pool_bytes: int) -> dict[str, int]:
    """{stage: bytes} for one launch over sequences of ``lengths`` tokens (1-token ones
    take the decode step): intra, WY, state (o fused), decode."""
    T = sum(n for n in lengths if n > 1)
    n_seq = sum(1 for n in lengths if n > 1)
    NT = sum(-(-n // CHUNK) for n in lengths if n > 1)
    mat = 2 if in_bytes == 2 else 4
    qk = 2 * T * H * K * in_bytes
    g, v, beta = T * HV * K * in_bytes, T * HV * V * in_bytes, T * HV * in_bytes
    tb, aqk, rqk = T * HV * CHUNK * mat, T * HV * CHUNK * mat, T * HV * 2 * 4
    o = T * HV * V * in_bytes
    states = 2 * n_seq * HV * K * V * pool_bytes  # read once, written once
    out: dict[str, int] = {}
    if T:
        wkq, u, gexp = 3 * T * HV * K * mat, T * HV * V * 4, NT * HV * K * 4
        out["intra"] = qk + g + beta + tb + aqk + rqk
        out["wy"] = qk + g + v + tb + rqk + wkq + u + gexp
        out["state"] = wkq + u + gexp + aqk + o + states
    n1 = sum(1 for n in lengths if n == 1)
    if n1:
        out["decode"] = n1 * (2 * H * K + HV * (K + V + 1) + HV * V) * in_bytes + 2 * n1 * HV * K * V * pool_bytes
    return out
