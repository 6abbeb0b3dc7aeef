"""Stage 2 of chunked KDA: the sequential chunk-to-chunk state pass, in place on the pool.

One program per (sequence, value head, V block). The state [K, BV] lives in registers in
fp32 across the sequence's chunks:

    h[chunk]  = S                                    (state before the chunk, STORE_H)
    v_new     = u - w S                              [64, BV]
    o         = qg S + A_qk v_new                    (FUSE_OUT; else the output stage does it)
    S         = diag(exp(G_last)) S + kg^T v_new

The initial state is read from ``pool[indices[seq]]`` and the final state written to
``pool[write_indices[seq]]`` (the same row unless the problem has
`PrefillProblem.write_indices`) by this kernel (no gather/scatter copies); index -1 reads
zeros, or writes nothing. A segment of a sequence cut into pieces (`kernels.triton_plan`)
reads and/or writes a carry row instead, by its segment-table entry. The pool is addressed
through its strides, so [S, HV, V, K] and [S, HV, K, V] layouts (fp32 or bf16) are one
code path. This kernel must never be autotuned: a timing run would advance live states.

Checkpoints (CHECKPOINT): when ``ckpt_addrs[chunk]`` holds an address, the state after
that chunk goes to the [HV, ., .] state there as well, in the pool's dtype
(`store_checkpoint`): the targets are the caller's tensors wherever they live (a cache's
entries), one int64 address each, so nothing is copied after the launch. CKPT_AT_END: the
plan ends a segment at every checkpoint (`triton_plan.piece_rows`' cuts), so only the
segment's last chunk can have one and it is stored after the chunk loop, which stays the
plain one; otherwise each chunk of the loop looks for its address.

Non-finite flags (FLAG): the program looks for NaN and Inf values in the o tiles it
stores (FUSE_OUT) and of the state it writes at the segment's end, as stored, and sets
``flags[sequence]`` when there are any (`flag_nonfinite`): a guard for the caller that
costs no second read. Inside the chunk loop an o tile is only folded into a per-row sum of
``o * 0`` (NaN where the row held a NaN or Inf, else 0; the sum runs along the tile's rows,
inside one warp, so no barrier); the sums are flagged once, after the loop.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .checks import flag_nonfinite
from .inputs import StageInputs, StateTargets
from .wy import WyOutputs


@triton.jit
def store_checkpoint(addr, i_hv, b_h, o_k, o_v, K: tl.constexpr, V: tl.constexpr, c_k, c_v, c_head, like):
    """Store the fp32 state tile b_h ([BK, BV]: key indices ``o_k``, value indices ``o_v``)
    to the state at address ``addr`` (int64, from the checkpoint table), head i_hv, key and
    value strides c_k, c_v, in the element type of ``like`` (the pool); nothing when the
    address is 0. The tile's offsets and mask are built from ``o_k + (addr >> 63)`` (0: user
    addresses lie below 2**63, which the compiler cannot know), so inside a loop they are
    computed in the branch instead of being hoisted to hold registers for the whole loop."""
    if addr != 0:
        base = addr.to(tl.pointer_type(like.dtype.element_ty))
        o_kz = o_k + (addr >> 63).to(tl.int32)
        mask = (o_kz < K)[:, None] & (o_v < V)[None, :]
        tl.store(base + i_hv * c_head + (o_kz[:, None] * c_k + o_v[None, :] * c_v), b_h.to(like.dtype.element_ty),
                 mask=mask)


@triton.jit
def chunk_step(b_h, o_bad, i_t, bos, eos, hoff, i_hv, w, u, kg, gexp, qg, aqk, o, v_new, h,
               o_t, o_k, o_v, m_k, m_v, m_kv, s_hk, s_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               FUSE_OUT: tl.constexpr, STORE_H: tl.constexpr, FLAG: tl.constexpr, DOT_PREC: tl.constexpr):
    """One chunk i_t of a segment [bos, eos) (h index of its first chunk ``hoff``) for value
    head i_hv and the V block ``o_v``: stores h (STORE_H), o (FUSE_OUT) or v_new, and returns
    the state after the chunk and the o rows' running NaN sum (FLAG)."""
    t0 = bos + i_t * 64
    m_t = o_t < eos - t0
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    i_g = hoff + i_t
    if STORE_H:
        p_h = h + (i_g * HV + i_hv) * (K * V) + (o_k[:, None] * s_hk + o_v[None, :] * s_hv)
        tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_kv)

    # one 64-bit scalar base pointer per tile (advanced each chunk), int32 in-tile offsets
    in_tk = o_t[:, None] * (HV * K) + o_k[None, :]
    in_tv = o_t[:, None] * (HV * V) + o_v[None, :]
    tk = (t0 * HV + i_hv) * K
    tv = (t0 * HV + i_hv) * V
    b_w = tl.load(w + tk + in_tk, mask=m_tk, other=0.0)
    b_v = tl.load(u + tv + in_tv, mask=m_tv, other=0.0)
    b_v -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PREC)
    if FUSE_OUT:
        b_q = tl.load(qg + tk + in_tk, mask=m_tk, other=0.0)
        b_a = tl.load(aqk + (t0 * HV + i_hv) * 64 + (o_t[:, None] * (HV * 64) + o_t[None, :]), mask=m_t[:, None],
                      other=0.0)
        b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PREC)
        b_o = tl.dot(b_a, b_v.to(b_a.dtype), b_o, input_precision=DOT_PREC).to(o.dtype.element_ty)
        tl.store(o + tv + in_tv, b_o, mask=m_tv)
        if FLAG:  # masked rows and columns of b_o are zeros (their operands load as 0)
            o_bad += tl.sum(b_o.to(tl.float32) * 0.0, axis=1)
    else:
        tl.store(v_new + tv + in_tv, b_v, mask=m_tv)

    b_gl = tl.load(gexp + (i_g * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    b_k = tl.load(kg + tk + in_tk, mask=m_tk, other=0.0)
    b_h = b_h * b_gl[:, None] + tl.dot(tl.trans(b_k), b_v.to(b_k.dtype), input_precision=DOT_PREC)
    return b_h, o_bad


@triton.jit
def chunk_state_kernel(
    w, u, kg, gexp, qg, aqk, o, v_new, h, pool, indices, write_indices, segs, carry, ckpt_addrs, flags,
    s_slot, s_head, s_pk, s_pv, s_hk, s_hv, c_head, c_k, c_v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    FUSE_OUT: tl.constexpr, STORE_H: tl.constexpr, CHECKPOINT: tl.constexpr, FLAG: tl.constexpr,
    DOT_PREC: tl.constexpr, CKPT_PREFETCH: tl.constexpr = False, CKPT_AT_END: tl.constexpr = False,
):
    """Grid (Ns * HV * cdiv(V, BV),). segs: [Ns, 6] int64 (sequence id, first token, end
    token, h index of its first chunk, carry row to load or -1, carry row to store or -1);
    carry: [NC, HV, K, V] fp32 (V contiguous).

    w, kg, qg: [T, HV, K] and aqk: [T, HV, 64] in the operand dtype (fp32 or fp16: the
    products cast S and v_new to it); u, v_new: [T, HV, V] and gexp: [NT, HV, K] fp32; o: [T, HV, V] in v's dtype (FUSE_OUT) ; v_new written unless FUSE_OUT;
    h: [NT, HV, .., ..] with strides s_hk, s_hv inside one [K, V] state (STORE_H);
    pool: slot stride s_slot, head stride s_head, element strides s_pk, s_pv; indices,
    write_indices: [N] int64, the rows read and written (-1: zeros, no write; always given,
    ``indices`` itself when the rows written are the rows read);
    ckpt_addrs [NT] int64 (head, key, value strides c_*) and flags [N + 1] int32 (FLAG) as
    in `StateTargets`. CKPT_PREFETCH: each chunk's checkpoint address is loaded one chunk
    ahead (carried through the loop) instead of just before its store, whose branch would
    otherwise wait for that load (`LaunchConfig.state_ckpt_prefetch`). CKPT_AT_END: only the
    segment's last chunk has a checkpoint, stored after the loop (`LaunchConfig.state_ckpt_levels`).
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v = tl.program_id(0) % NV
    i_nh = tl.program_id(0) // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    seq = tl.load(segs + i_n * 6)
    bos = tl.load(segs + i_n * 6 + 1)
    eos = tl.load(segs + i_n * 6 + 2)
    hoff = tl.load(segs + i_n * 6 + 3)
    load_carry = tl.load(segs + i_n * 6 + 4)
    store_carry = tl.load(segs + i_n * 6 + 5)
    slot = tl.load(indices + seq)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if load_carry >= 0:
        b_h = tl.load(carry + (load_carry * HV + i_hv) * (K * V) + (o_k[:, None] * V + o_v[None, :]),
                      mask=m_kv, other=0.0)
    else:  # slot -1: zeros
        p_pool = pool + slot * s_slot + i_hv * s_head + (o_k[:, None] * s_pk + o_v[None, :] * s_pv)
        b_h = tl.load(p_pool, mask=m_kv & (slot + o_k * 0 >= 0)[:, None], other=0.0).to(tl.float32)

    o_t = tl.arange(0, 64)
    o_bad = tl.zeros([64], dtype=tl.float32)  # FLAG: sum over the chunks' o rows of o * 0
    m_k = o_k < K
    m_v = o_v < V
    n_chunks = tl.cdiv(eos - bos, 64)
    IN_LOOP: tl.constexpr = CHECKPOINT and not CKPT_AT_END
    if IN_LOOP and CKPT_PREFETCH:
        ck_next = tl.load(ckpt_addrs + hoff)
    for i_t in range(n_chunks):
        if IN_LOOP and CKPT_PREFETCH:  # this chunk's address, loaded one chunk ago; the next one's now
            ck_addr = ck_next
            ck_next = tl.load(ckpt_addrs + hoff + i_t + 1, mask=i_t + 1 < n_chunks, other=0)
        b_h, o_bad = chunk_step(b_h, o_bad, i_t, bos, eos, hoff, i_hv, w, u, kg, gexp, qg, aqk, o, v_new, h,
                                o_t, o_k, o_v, m_k, m_v, m_kv, s_hk, s_hv, HV, K, V, FUSE_OUT, STORE_H, FLAG,
                                DOT_PREC)
        if IN_LOOP:
            if not CKPT_PREFETCH:
                ck_addr = tl.load(ckpt_addrs + hoff + i_t)
            store_checkpoint(ck_addr, i_hv, b_h, o_k, o_v, K, V, c_k, c_v, c_head, pool)
    if CHECKPOINT and CKPT_AT_END:
        store_checkpoint(tl.load(ckpt_addrs + hoff + n_chunks - 1), i_hv, b_h, o_k, o_v, K, V, c_k, c_v, c_head, pool)

    if FLAG and FUSE_OUT:
        flag_nonfinite(flags + seq, o_bad, o_t < 64)
    if store_carry >= 0:
        tl.store(carry + (store_carry * HV + i_hv) * (K * V) + (o_k[:, None] * V + o_v[None, :]), b_h, mask=m_kv)
        if FLAG:
            flag_nonfinite(flags + seq, b_h, m_kv)
    else:  # dst -1: no write
        dst = tl.load(write_indices + seq)
        p_pool = pool + dst * s_slot + i_hv * s_head + (o_k[:, None] * s_pk + o_v[None, :] * s_pv)
        b_final = b_h.to(pool.dtype.element_ty)
        tl.store(p_pool, b_final, mask=m_kv & (dst + o_k * 0 >= 0)[:, None])
        if FLAG:
            flag_nonfinite(flags + seq, b_final, m_kv)


log = logging.getLogger(__name__)
_STAGES_THAT_FIT: dict[Hashable, int] = {}  # by compiled variant: the pipeline stages it launched with


def launch_fitting(launch: Callable[[int], None], variant: Hashable, stages: int) -> int:
    """``launch(stages)``, or with fewer pipeline stages when that many ask more shared
    memory than a block may take: Triton raises OutOfResources as it loads the compiled
    kernel, before the launch, so nothing has run and no pool row is touched. The count
    that fit is kept by ``variant`` (the compiled variant's key: its later launches start
    there) and logged once. Returns the stages it launched with."""
    n = _STAGES_THAT_FIT.get(variant, stages)
    while True:
        try:
            launch(n)
            return n
        except OutOfResources as e:
            if n <= 1:
                raise
            log.info("state pass %s: %d pipeline stages do not fit (%s); launching it with %d", variant, n, e, n - 1)
            n -= 1
            _STAGES_THAT_FIT[variant] = n


def launch_state(x: StageInputs, segs: torch.Tensor, wy: WyOutputs, aqk: torch.Tensor, o: torch.Tensor,
                 v_new: Optional[torch.Tensor], st: StateTargets, carry: torch.Tensor,
                 launch: tuple[int, int, int], prefetch: bool = True, at_end: bool = False) -> None:
    """The state pass over the segment rows ``segs`` ([Ns, 6], `kernels.triton_plan`), from
    the WY factors ``wy`` and A_qk ``aqk`` [T, HV, 64]: o [T, HV, V] when ``v_new`` is None
    (fused output), else v_new [T, HV, V] fp32 and the per-chunk states ``st.h`` for the
    output stage; final states to the pool, checkpoints to ``st.ckpt_addrs``' targets,
    non-finite flags to ``st.flags``. ``launch``: (BV, warps, stages) from `config.state_launch`
    (fewer stages when that many do not fit: `launch_fitting`); ``prefetch``: load each
    checkpoint address a chunk ahead (`LaunchConfig.state_ckpt_prefetch`); ``at_end``: the
    plan ends a segment at each checkpoint, stored after the chunk loop
    (`LaunchConfig.state_ckpt_levels`)."""
    bv, warps, stages = launch
    h, ckpt_addrs = st.pointers(o)
    fused = v_new is None
    args = (wy.w, wy.u, wy.kg, wy.gexp, wy.qg, aqk, o, o if fused else v_new, h, st.pool, st.indices,
            st.write_indices, segs, carry, ckpt_addrs, st.flag_pointer(st.indices), *st.pool_strides,
            *st.h_strides, *st.ckpt_strides)
    consts = dict(HV=x.HV, K=x.K, V=x.V, BK=max(16, triton.next_power_of_2(x.K)), BV=bv, FUSE_OUT=fused,
                  STORE_H=st.h is not None, CHECKPOINT=st.ckpt_addrs is not None, FLAG=st.flags is not None,
                  DOT_PREC=x.dot_prec, CKPT_PREFETCH=prefetch and not at_end, CKPT_AT_END=at_end)
    grid = (segs.shape[0] * x.HV * triton.cdiv(x.V, bv),)
    # what selects a compiled variant: constexprs, warps, pointer dtypes, strides of 1 (Triton specializes them)
    variant = (x.device, stages, warps, tuple(consts.items()), x.mat, o.dtype, st.pool.dtype,
               tuple(s == 1 for s in (*st.pool_strides, *st.h_strides, *st.ckpt_strides)))
    launch_fitting(lambda n: chunk_state_kernel[grid](*args, **consts, num_warps=warps, num_stages=n), variant, stages)
