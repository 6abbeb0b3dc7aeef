"""Torch chunked KDA: the CPU backend.

Chunk 64 in WY form, vectorized over every chunk of every sequence and head, with one
sequential pass over chunk steps for the chunk-to-chunk state. Single-token sequences
take a batched recurrent step instead.

Decays stay finite for real gates: no exp(G) is ever split as exp(G_t) * exp(-G_s).
Within a chunk, pairs in different 16-token sub-blocks factor through the cumulative
decay at the start of the later sub-block (both factors are exp of a non-positive
number); pairs in the same sub-block use pairwise exponents. Exponents are differences
of a float64 cumulative sum, so a token with a decay of -2600 does not wash out the
small decays after it.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .checkpoints import checkpoint_targets
from .transforms import beta_transform, l2norm, log_decay
from .problem import CHUNK_SIZE, PrefillProblem, save_initial_states

SUB_BLOCK = 16
# Elements of the largest intra-chunk temporary ([n, C/16, C, K] decayed keys) per group
# of chunk-heads: small enough to stay in cache, large enough to amortize op overhead.
INTRA_GROUP_ELEMENTS = 1 << 19
# Largest |log decay| inside one sub-block for which exp(x) and exp(-x) both stay normal
# fp32 numbers (exp(-87.3) is the smallest normal).
FACTOR_LIMIT = 80.0


@dataclass
class _Prepared:
    """fp32 inputs after gate, norms, scale, beta transform and GVA expansion.

    q, k, g: [T, HV, K]; v: [T, HV, V]; beta: [T, HV].
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def _f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32: itself when it already is (no dispatch for a no-op conversion)."""
    return x if x.dtype is torch.float32 else x.to(torch.float32)


def _pool_typed(p: PrefillProblem, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the pool's dtype: itself when it already is (an fp32 pool)."""
    return x if x.dtype is p.pool.dtype else x.to(p.pool.dtype)


def prepare_inputs(p: PrefillProblem) -> _Prepared:
    """Apply the fused input transforms (docs/KDA.md) in fp32."""
    q, k = _f32(p.q), _f32(p.k)
    if p.use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * p.scale
    group = p.v.shape[1] // p.q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    a_log = None if p.A_log is None else _f32(p.A_log)
    bias = None if p.dt_bias is None else _f32(p.dt_bias)
    g = log_decay(_f32(p.g), a_log, bias, p.lower_bound)
    beta = beta_transform(_f32(p.beta), p.use_beta_sigmoid, p.allow_neg_eigval)
    return _Prepared(q=q, k=k, v=_f32(p.v), g=g, beta=beta)


def _write_rows(p: PrefillProblem) -> torch.Tensor:
    """[N] int64: the pool row each sequence of ``p`` writes its final state to (-1: none)."""
    return p.indices if p.write_indices is None else p.write_indices


def _every_row(p: PrefillProblem) -> bool:
    """Whether every sequence of ``p`` reads and writes a pool row (no index -1 in the rows
    read nor in those written): the service's launches. Then the states are read and
    written without masks."""
    return min(p.indices.tolist() + _write_rows(p).tolist()) >= 0  # host ints: one read each, no kernels


def _read_states(p: PrefillProblem, every_row: bool) -> torch.Tensor:
    """Initial states in math layout [N, HV, K, V] fp32; zeros where the index is -1."""
    idx = p.indices
    if every_row:
        rows = _f32(p.pool.index_select(0, idx))
        return (rows.transpose(-1, -2) if p.state_v_first else rows).contiguous()
    live = idx >= 0
    rows = _f32(p.pool.index_select(0, idx.clamp(min=0)))
    if p.state_v_first:
        rows = rows.transpose(-1, -2)
    return torch.where(live[:, None, None, None], rows, torch.zeros_like(rows)).contiguous()


def _write_states(p: PrefillProblem, states: torch.Tensor, every_row: bool) -> None:
    """Write math-layout states [N, HV, K, V] to the pool rows they go to (`_write_rows`;
    index -1 skipped)."""
    targets = _write_rows(p)
    if every_row:
        p.pool.index_copy_(0, targets, _pool_typed(p, states.transpose(-1, -2) if p.state_v_first else states))
        return
    live = (targets >= 0).nonzero().flatten()
    if live.numel() == 0:
        return
    rows = states.index_select(0, live)
    if p.state_v_first:
        rows = rows.transpose(-1, -2)
    p.pool.index_copy_(0, targets.index_select(0, live), _pool_typed(p, rows))


def _checkpoints_by_chunk(p: PrefillProblem) -> list[tuple[int, int, int]]:
    """(sequence n, chunk j of it, checkpoint row) of each checkpoint position of ``p``."""
    out = []
    for row, pos in enumerate(p.checkpoint_tokens):
        n = bisect_left(p.bounds, pos) - 1  # bounds[n] < pos <= bounds[n + 1]
        out.append((n, (pos - p.bounds[n] - 1) // CHUNK_SIZE, row))
    return out


def _write_checkpoints(p: PrefillProblem, saved: dict[int, torch.Tensor]) -> None:
    """Math-layout states [HV, K, V] by checkpoint into their targets (pool layout and
    dtype; `checkpoint_targets`, asked once)."""
    targets = checkpoint_targets(p)
    for c, state in saved.items():
        targets[c].copy_(state.transpose(-1, -2) if p.state_v_first else state)


def recurrent_step(
    x: _Prepared, tokens: Optional[torch.Tensor], states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. tokens: [M] token positions (None: every token of ``x``, in
    order: M = T); states: [M, HV, K, V].

    Returns (o [M, HV, V], new states [M, HV, K, V]), fp32.
    """
    q, k, v, g, beta = (x.q, x.k, x.v, x.g, x.beta) if tokens is None else (
        x.q[tokens], x.k[tokens], x.v[tokens], x.g[tokens], x.beta[tokens])
    M, HV, K, V = states.shape
    B = M * HV  # one batched product per (sequence, head): [B, K, V] states
    S = states.reshape(B, K, V) * torch.exp(g).reshape(B, K, 1)
    r = torch.baddbmm(v.reshape(B, 1, V), k.reshape(B, 1, K), S, alpha=-1)  # v - k S
    S = torch.baddbmm(S, k.reshape(B, K, 1), r * beta.reshape(B, 1, 1))  # S + k (beta (v - k S))
    return torch.bmm(q.reshape(B, 1, K), S).view(M, HV, V), S.view(M, HV, K, V)


@dataclass
class _ChunkLayout:
    """Multi-token sequences cut into chunks, ordered step-major.

    Sequences are sorted by chunk count, descending, so that at step c the active
    sequences are a prefix of length ``active[c]`` and their chunks are the contiguous
    range ``offsets[c] : offsets[c] + active[c]`` of the chunk axis.
    token_index: token positions; chunk_index / pos_index: each one's chunk and place in it.
    One sequence: token_index is the slice of its rows, which are its chunks in order
    (the last zero-padded), and chunk_index / pos_index are None: no gather, no scatter.
    """

    order: list[int]
    active: list[int]
    offsets: list[int]
    num_chunks: int
    token_index: Union[torch.Tensor, slice]
    chunk_index: Optional[torch.Tensor]
    pos_index: Optional[torch.Tensor]

    def to_chunks(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token rows [T, HV, *D] (D: one dim or none) of tensors of one shape into
        zero-padded, head-major chunks [NC * HV, C, *D] each, contiguous. One sequence: the
        tensors stacked and chunked as one (a small launch pays per call, not per byte)."""
        NC, C, m = self.num_chunks, CHUNK_SIZE, len(xs)
        HV, D = xs[0].shape[1], xs[0].shape[2:]
        if self.chunk_index is None:
            rows = torch.stack(xs) if m > 1 else xs[0].unsqueeze(0)  # [m, T, HV, *D]
            if not (self.token_index.start == 0 and self.token_index.stop == rows.shape[1]):
                rows = rows[:, self.token_index]
            pad = NC * C - rows.shape[1]
            if pad:
                rows = torch.cat([rows, rows.new_zeros(m, pad, HV, *D)], dim=1)
            return rows.view(m, NC, C, HV, *D).transpose(2, 3).contiguous().view(m, NC * HV, C, *D).unbind()
        chunks = []
        for x in xs:
            buf = x.new_zeros(NC, HV, C, *D)
            buf[self.chunk_index, :, self.pos_index] = x[self.token_index]
            chunks.append(buf.view(NC * HV, C, *D))
        return tuple(chunks)

    def from_chunks(self, o: torch.Tensor) -> torch.Tensor:
        """Chunks [NC, HV, C, V] back to the rows [T', HV, V] of the tokens of ``token_index``."""
        if self.chunk_index is None:
            rows = o.transpose(1, 2).reshape(-1, *o.shape[1:2], *o.shape[3:])
            length = self.token_index.stop - self.token_index.start
            return rows if length == rows.shape[0] else rows[:length]
        return o[self.chunk_index, :, self.pos_index]


def _chunk_layout(starts: list[int], lengths: list[int], device: torch.device) -> _ChunkLayout:
    C = CHUNK_SIZE
    counts = [(n + C - 1) // C for n in lengths]
    if len(lengths) == 1:
        return _ChunkLayout(order=[0], active=[1] * counts[0], offsets=list(range(counts[0] + 1)),
                            num_chunks=counts[0], token_index=slice(starts[0], starts[0] + lengths[0]),
                            chunk_index=None, pos_index=None)
    order = sorted(range(len(lengths)), key=lambda m: -counts[m])
    steps = counts[order[0]]
    active = [sum(1 for m in order if counts[m] > c) for c in range(steps)]
    offsets = [0]
    for a in active:
        offsets.append(offsets[-1] + a)
    tok, chunk, pos = [], [], []
    for rank, m in enumerate(order):
        for c in range(counts[m]):
            width = min(C, lengths[m] - c * C)
            tok.append(torch.arange(starts[m] + c * C, starts[m] + c * C + width))
            chunk.append(torch.full((width,), offsets[c] + rank))
            pos.append(torch.arange(width))
    return _ChunkLayout(
        order=order, active=active, offsets=offsets, num_chunks=offsets[-1],
        token_index=torch.cat(tok).to(device), chunk_index=torch.cat(chunk).to(device),
        pos_index=torch.cat(pos).to(device),
    )


@dataclass
class _ChunkTerms:
    """Per-chunk WY terms, [n, ...] fp32 over chunk-heads:

    wq [2C, K]: w (rows :C) and q * exp(G) (rows C:), so one product with the chunk's
    initial state S0 gives both w S0 and the inter-chunk output; u [C, V]: u0 on entry,
    such that the chunk's new values are u0 - w S0 (the state pass completes it in place);
    aqk [C, C]: decayed q.k for s <= t; kd [C, K] = k * exp(G_last - G); decay [K] = exp(G_last).
    """

    wq: torch.Tensor
    u: torch.Tensor
    aqk: torch.Tensor
    kd: torch.Tensor
    decay: torch.Tensor

    def by_chunk(self, heads: int) -> _ChunkTerms:
        """The terms of chunk-heads [NC * heads, ...] as [NC, heads, ...] (views)."""
        return _ChunkTerms(*(getattr(self, f).unflatten(0, (-1, heads)) for f in _ChunkTerms.__dataclass_fields__))


def _intra_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: _ChunkTerms
) -> None:
    """WY terms for n chunk-heads, written into ``out``.

    q, k, g: [n, C, K]; v: [n, C, V]; beta: [n, C].
    """
    n, C, K = q.shape
    S = SUB_BLOCK
    nb = C // S
    G = g.double().cumsum(1)  # [n, C, K], float64 so that differences keep their bits
    Gb = G.view(n, nb, S, K)
    ends = Gb[:, :, -1]  # [n, nb, K]: cumulative decay at each sub-block's end
    R = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)  # before each sub-block
    local = (Gb - R[:, :, None]).float()  # G_t - R_i, t in sub-block i
    to_end = (ends[:, :, None] - Gb).float()  # G_end(i) - G_s, s in sub-block i
    # A sub-block is tame when every |G - R_i| inside it is within FACTOR_LIMIT: then
    # exp(G_t - G_s) = exp(G_t - R_i) * exp(R_i - G_s) holds in fp32 for t, s in it.
    spread = local.abs()
    all_tame = spread.max().item() <= FACTOR_LIMIT  # the common case: no mask, no pairwise pass
    tame = None if all_tame else spread.amax(dim=(-1, -2)) <= FACTOR_LIMIT  # [n, nb]
    # Decays between sub-block boundaries, all <= 1: exp(ends_j - ends_i) for j >= i.
    span = torch.exp((ends[:, None, :, :] - ends[:, :, None, :]).float())  # [n, nb(i), nb(j), K]

    qb, kb = q.view(n, nb, S, K), k.view(n, nb, S, K)
    t_fac = torch.exp(local)
    q_t, k_t = qb * t_fac, kb * t_fac
    k_end = kb * torch.exp(to_end)  # k_s decayed to the end of its sub-block
    # ks[:, i] holds every key s up to the end of sub-block i, decayed to R_i: those of each
    # sub-block j < i through the span to the end of sub-block i - 1, in one broadcast (the
    # spans of j >= i grow, may overflow, and are masked; the diagonal j = i is set next)
    ks = q.new_zeros(n, nb, nb, S, K)
    spans = span.permute(0, 3, 1, 2)[..., :-1].triu().permute(0, 3, 2, 1).contiguous()  # [n, i - 1, j, K], 0 for j >= i
    ks[:, 1:] = k_end[:, None] * spans[:, :, :, None]
    own = kb * torch.exp(-local)  # inf where a wild sub-block overflows: masked next
    ks.diagonal(dim1=1, dim2=2).copy_((own if all_tame else torch.where(tame[:, :, None, None], own, 0.0))
                                      .permute(0, 2, 3, 1))
    ks = ks.view(n, nb, C, K)
    keys = ks.transpose(-1, -2).reshape(n * nb, K, C)  # a view: products per sub-block, as batched matmuls
    aqk = torch.bmm(q_t.view(n * nb, S, K), keys).view(n, C, C)
    akk = torch.bmm(k_t.view(n * nb, S, K), keys).view(n, C, C)

    # Wild sub-blocks (a decay beyond FACTOR_LIMIT inside one): pairwise exponents.
    wild = None if all_tame else (~tame).nonzero(as_tuple=True)
    if wild is not None:
        Gw = Gb[wild]  # [U, S, K]
        tri = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        diff = (Gw[:, :, None] - Gw[:, None]).masked_fill(~tri[:, :, None], float("-inf"))
        kE = torch.exp(diff.float()) * kb[wild][:, None]  # [U, S(t), S(s), K]
        for a, x in ((aqk, qb[wild]), (akk, kb[wild])):
            view = a.view(n, nb, S, nb, S)
            view[wild[0], wild[1], :, wild[1], :] = (x[:, :, None] * kE).sum(-1)

    # exp(G_t) = exp(R_i) * exp(G_t - R_i) and exp(G_last - G_s) = exp(G_last - ends_i) *
    # exp(ends_i - G_s): products of factors <= 1, so no extra exp and no overflow.
    decay_r = torch.exp(R.float())  # [n, nb, K]; R[:, 1] is ends[:, 0]
    eG = (t_fac * decay_r[:, :, None]).view(n, C, K)
    torch.mul(eG, q, out=out.wq[:, C:])
    torch.mul(k_end, span[:, :, -1, None], out=out.kd.view(n, nb, S, K))
    torch.mul(span[:, 0, -1], decay_r[:, 1], out=out.decay)
    torch.tril(aqk, out=out.aqk)
    # I + strict lower part of beta_t A_kk[t, s]: the solve reads only that triangle (its
    # unit diagonal implied), so the rest of the product is never masked
    L = akk * beta[..., None]
    bk = beta[..., None] * k
    rhs = torch.cat([bk * eG, beta[..., None] * v], dim=-1)
    sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    out.wq[:, :C] = sol[..., :K]
    out.u.copy_(sol[..., K:])


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> _ChunkTerms:
    """WY terms for every chunk-head, in cache-sized groups.

    q, k, g: [NC * HV, C, K]; v: [NC * HV, C, V]; beta: [NC * HV, C] (chunk-major, as
    `_ChunkLayout.to_chunks` gives them); returns terms shaped [NC * HV, ...].
    """
    total, C, K = q.shape
    V = v.shape[-1]
    flat = (q, k, v, g, beta)
    out = _ChunkTerms(
        wq=q.new_empty(total, 2 * C, K), u=q.new_empty(total, C, V), aqk=q.new_empty(total, C, C),
        kd=q.new_empty(total, C, K), decay=q.new_empty(total, K),
    )
    fields = _ChunkTerms.__dataclass_fields__
    step = max(1, INTRA_GROUP_ELEMENTS // (C // SUB_BLOCK * C * K))
    if total <= step:  # one group: the whole tensors, no slices
        _intra_group(*flat, out=out)
    else:
        for a in range(0, total, step):
            part = _ChunkTerms(*(getattr(out, f)[a : a + step] for f in fields))
            _intra_group(*(x[a : a + step] for x in flat), out=part)
    return out


def _one_chunk(terms: _ChunkTerms, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_pass`'s state pass for a single chunk: (o [1, HV, C, V], the final state
    [1, HV, K, V]) from its terms ([HV, ...], `_intra_chunk`'s) and initial state [1, HV,
    K, V], the same products as the stepped pass without its slices and copies
    (``terms.u`` is completed in place)."""
    _, HV, K, V = states.shape
    C = terms.u.shape[1]
    S0 = states.view(HV, K, V)
    P = torch.bmm(terms.wq, S0)  # [HV, 2C, V]: w S0 and q exp(G) S0
    u = terms.u.sub_(P[:, :C])
    o = P[:, C:] + terms.aqk @ u
    final = torch.baddbmm(terms.decay.unsqueeze(-1) * S0, terms.kd.transpose(-1, -2), u).view_as(states)
    return o.unsqueeze(0), final


def chunked_pass(
    x: _Prepared, starts: list[int], lengths: list[int], states: torch.Tensor, keep_intermediate: bool,
    after: Optional[dict[int, list[tuple[int, int]]]] = None,
) -> tuple[Union[torch.Tensor, slice], torch.Tensor, torch.Tensor, Optional[list[torch.Tensor]],
           dict[int, torch.Tensor]]:
    """Run multi-token sequences. states: [M, HV, K, V] initial states, one per sequence.
    ``after``: for chunk step c, the (sequence m, checkpoint row) pairs that want the state
    of sequence m after its chunk c.

    Returns (token_index [T'] (a slice for one sequence), o [T', HV, V] for those tokens, final states [M, HV, K, V],
    with keep_intermediate a list per sequence of [NC_m, HV, K, V] states before each chunk,
    and the checkpoint states [HV, K, V] by row).
    """
    C = CHUNK_SIZE
    layout = _chunk_layout(starts, lengths, x.q.device)
    if x.v.shape == x.q.shape:  # K = V: the four chunked as one
        q, k, v, g = layout.to_chunks(x.q, x.k, x.v, x.g)
    else:
        (q, k, g), (v,) = layout.to_chunks(x.q, x.k, x.g), layout.to_chunks(x.v)
    (beta,) = layout.to_chunks(x.beta)
    terms = _intra_chunk(q, k, v, g, beta)

    if layout.num_chunks == 1 and not keep_intermediate and not after:
        o, finals = _one_chunk(terms, states)
        return layout.token_index, layout.from_chunks(o), finals, None, {}
    terms = terms.by_chunk(states.shape[1])
    in_order = layout.order == sorted(layout.order)
    order = None if in_order else torch.tensor(layout.order, device=states.device)
    S = states.clone() if order is None else states.index_select(0, order)  # sorted by chunk count, descending
    o = torch.empty_like(terms.u)  # [NC, HV, C, V]
    h = S.new_empty(layout.num_chunks, *S.shape[1:]) if keep_intermediate else None
    rank_of = {m: rank for rank, m in enumerate(layout.order)}
    saved: dict[int, torch.Tensor] = {}
    for c, n_act in enumerate(layout.active):
        sl = slice(layout.offsets[c], layout.offsets[c] + n_act)
        S_c = S[:n_act]
        if h is not None:
            h[sl] = S_c
        P = terms.wq[sl] @ S_c  # [n, HV, 2C, V]: w S0 and q exp(G) S0
        u = terms.u[sl].sub_(P[:, :, :C])
        o[sl] = P[:, :, C:]
        S[:n_act] = torch.baddbmm(
            (terms.decay[sl][..., None] * S_c).flatten(0, 1),
            terms.kd[sl].transpose(-1, -2).flatten(0, 1), u.flatten(0, 1),
        ).view_as(S_c)
        for m, row in (after or {}).get(c, ()):
            saved[row] = S[rank_of[m]].clone()
    o += terms.aqk @ terms.u
    if order is None:
        finals = S
    else:
        finals = torch.empty_like(S)
        finals[order] = S
    o_tok = layout.from_chunks(o)
    inter = None
    if h is not None:
        inter = [None] * len(lengths)
        for rank, m in enumerate(layout.order):
            n_chunks = (lengths[m] + C - 1) // C
            inter[m] = torch.stack([h[layout.offsets[c] + rank] for c in range(n_chunks)])
    return layout.token_index, o_tok, finals, inter, saved


def run_torch(p: PrefillProblem) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The torch backend: see `kernels.problem.Backend`."""
    if p.saved_states is not None:
        save_initial_states(p)
    if p.input_checks is not None:
        _check_inputs(p)
    x = prepare_inputs(p)
    every_row = _every_row(p)
    states = _read_states(p, every_row)  # [N, HV, K, V]
    if len(p.lengths) == x.q.shape[0] and not p.checkpoint_tokens:  # one token per sequence: a decode step
        o, finals = recurrent_step(x, None, states)
        inter, saved = (states if p.output_intermediate_states else None), {}
    else:
        o, finals, inter, saved = _sequences_pass(p, x, states)
    _write_states(p, finals, every_row)
    if saved:
        _write_checkpoints(p, saved)
    h = None
    if inter is not None:
        h = (inter.transpose(-1, -2) if p.state_v_first else inter).contiguous()
    o = _output(p, o)
    if p.nonfinite is not None:
        _flag_nonfinite(p, o, _pool_typed(p, finals))
    return o, h


def _sequences_pass(p: PrefillProblem, x: _Prepared, states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], dict[int, torch.Tensor]]:
    """Every sequence of ``p`` from its initial state (``states`` [N, HV, K, V]): those of
    one token by a recurrent step, the others chunked (`chunked_pass`). Returns o [T, HV,
    V] and the final states [N, HV, K, V] fp32, with ``output_intermediate_states`` the
    states before each chunk of each sequence [sum of chunks, HV, K, V] (else None), and
    the checkpoint states [HV, K, V] by checkpoint row."""
    starts, lengths = list(p.bounds[:-1]), p.lengths
    single = [n for n, length in enumerate(lengths) if length == 1]
    multi = [n for n, length in enumerate(lengths) if length > 1]
    finals = states.clone() if single else states  # every sequence chunked: replaced by chunked_pass's
    # one sequence, chunked, holds every token: o is chunked_pass's own (no copy into a buffer)
    o = torch.empty(x.v.shape, dtype=torch.float32, device=x.v.device) if single or len(multi) > 1 else None
    inter: list[Optional[torch.Tensor]] = [None] * len(lengths)

    if single:
        sel = torch.tensor(single, device=states.device)
        tokens = torch.tensor([starts[n] for n in single], device=states.device)
        o[tokens], finals[sel] = recurrent_step(x, tokens, states[sel])
        for n in single:
            inter[n] = states[n : n + 1]
    wanted = _checkpoints_by_chunk(p)
    saved: dict[int, torch.Tensor] = {}
    if multi:
        sel = None if not single else torch.tensor(multi, device=states.device)
        local = {n: m for m, n in enumerate(multi)}
        after: dict[int, list[tuple[int, int]]] = {}
        for n, j, row in wanted:
            if n in local:
                after.setdefault(j, []).append((local[n], row))
        tok, o_tok, f, hs, saved = chunked_pass(
            x, [starts[n] for n in multi], [lengths[n] for n in multi], states if sel is None else states[sel],
            p.output_intermediate_states, after,
        )
        if o is None:
            o = o_tok
        else:
            o[tok] = o_tok
        if sel is None:
            finals = f
        else:
            finals[sel] = f
        if hs is not None:
            for j, n in enumerate(multi):
                inter[n] = hs[j]
    for n, _, row in wanted:
        if lengths[n] == 1:
            saved[row] = finals[n]
    return o, finals, torch.cat(inter) if p.output_intermediate_states else None, saved


def _output(p: PrefillProblem, o: torch.Tensor) -> torch.Tensor:
    """o [T, HV, V] in v's dtype, contiguous as the Triton backend's (a lone chunked
    sequence's o arrives as a view of its chunk layout): in ``p.o_out`` when the caller
    gave it."""
    if p.o_out is None:
        return o.to(p.v.dtype).contiguous()
    p.o_out.copy_(o)
    return p.o_out


def _check_inputs(p: PrefillProblem) -> None:
    """``p.input_checks`` (`kernels.problem.PrefillProblem.input_checks`) from the raw
    inputs, which this backend reads whole: each one's min and max as host scalars (a
    quarter of the time of tensor arithmetic for a small request on the CPU; on a GPU the
    reads wait for the device, which this backend, the CPU's, accepts)."""
    log_decay = p.A_log is None and p.lower_bound is None  # g is the log decay: > 0 fails
    for t in (p.q, p.k, p.v, p.g, p.beta):
        lo, hi = map(float, torch.aminmax(t))
        if not (math.isfinite(lo) and math.isfinite(hi)) or (log_decay and t is p.g and hi > 0):
            p.input_checks.fill_(1)
            return


def _flag_nonfinite(p: PrefillProblem, o: torch.Tensor, finals: torch.Tensor) -> None:
    """``p.nonfinite[n]`` set for each sequence n whose final state (``finals`` [N, HV, K,
    V] in the pool's dtype) or whose tokens of ``o`` [T, HV, V] hold a NaN or Inf (all on
    one device). One sequence: two host scalars (0, or NaN for a NaN or Inf), as
    `_check_inputs` reads its own."""
    if finals.shape[0] == 1:  # one sequence: all of o is its
        if not math.isfinite((finals * 0).sum().item() + (o * 0).sum().item()):
            p.nonfinite[0] = 1
        return
    bad = _nan_rows(finals)  # [N]
    tokens = _nan_rows(o)  # [T]
    if tokens.shape[0] == bad.shape[0]:  # one token per sequence (none is empty)
        bad = bad + tokens
    else:
        counts = torch.cat([tokens.new_zeros(1, dtype=torch.int64), torch.cumsum(tokens.isnan(), 0)])  # [T + 1]
        bounds = torch.tensor(p.bounds, dtype=torch.int64, device=o.device)
        bad = bad + (counts[bounds[1:]] - counts[bounds[:-1]])
    p.nonfinite[:-1] |= bad != 0


def _nan_rows(x: torch.Tensor) -> torch.Tensor:
    """[R]: 0 where row r of ``x`` [R, ...] is all finite, NaN where it holds a NaN or Inf.
    x * 0 is a signed zero or NaN, and a sum of zeros cannot overflow: two kernels, where
    ``torch.isfinite`` alone is five on the CPU (abs, ne, eq, mul and a copy)."""
    return (x * 0).flatten(1).sum(dim=1)
