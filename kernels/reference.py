"""Per-token recurrent KDA: the oracle every backend is tested against.

Written directly from the per-token math in docs/KDA.md, one token at a time, with no
chunking and no factoring of decays, in float64 (or float32 for the speed baseline).
"""
from __future__ import annotations

import torch

from .transforms import beta_transform, l2norm, log_decay


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    use_beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run KDA token by token over packed sequences.

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (raw when A_log or lower_bound is given,
    else the log decay); beta: [T, HV] (logits when ``use_beta_sigmoid``);
    initial_state: [N, HV, V, K] (V-first) or None for zeros; cu_seqlens: [N + 1] or None
    for one sequence. A_log [HV], dt_bias [HV, K] as in the gate formulas.

    Returns ``(o, final_state)``: o [T, HV, V] and final_state [N, HV, V, K], both in ``dtype``.
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"HV ({HV}) must be a multiple of H ({H})")
    if scale is None:
        scale = K ** -0.5
    bounds = [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    n_seq = len(bounds) - 1

    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    a_log = None if A_log is None else A_log.to(dtype)
    bias = None if dt_bias is None else dt_bias.to(dtype).reshape(HV, K)
    g = log_decay(g, a_log, bias, lower_bound)
    beta = beta_transform(beta, use_beta_sigmoid, allow_neg_eigval)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    group = HV // H
    q = q.repeat_interleave(group, dim=1)  # [T, HV, K]
    k = k.repeat_interleave(group, dim=1)

    o = torch.empty(T, HV, V, dtype=dtype, device=q.device)
    final = torch.empty(n_seq, HV, V, K, dtype=dtype, device=q.device)
    for n in range(n_seq):
        if initial_state is None:
            S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)  # math layout [K, V]
        else:
            S = initial_state[n].to(dtype).transpose(-1, -2).clone()
        for t in range(bounds[n], bounds[n + 1]):
            S = S * torch.exp(g[t])[:, :, None]
            kt = k[t]  # [HV, K]
            pred = torch.einsum("hk,hkv->hv", kt, S)
            delta = beta[t][:, None] * (v[t] - pred)
            S = S + kt[:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], S)
        final[n] = S.transpose(-1, -2)
    return o, final
