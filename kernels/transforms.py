"""KDA's per-token input transforms in torch: the gates (raw g to the log decay: softplus
or lower bound), the q/k L2 norm and the beta activation.

All functions compute in the dtype of their (upcast) inputs and are used by the
reference and by the torch backend alike; the Triton kernels fuse the same formulas.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def softplus_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Softplus gate: ``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h, :])``.

    g_raw: [..., HV, K]; A_log: [HV]; dt_bias: [HV, K] or None (zero).
    Returns the log decay, [..., HV, K], in g_raw's dtype.
    """
    x = g_raw if dt_bias is None else g_raw + dt_bias.to(g_raw.dtype)
    return -torch.exp(A_log.to(g_raw.dtype))[:, None] * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)


def lower_bound_gate(
    g_raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float
) -> torch.Tensor:
    """Lower-bound gate: ``g = L * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, :]))``.

    g_raw: [..., HV, K]; A_log: [HV] or None (zero, i.e. a factor of 1); dt_bias: [HV, K] or None.
    Each token's log decay lies in (L, 0). Returns [..., HV, K] in g_raw's dtype.
    """
    x = g_raw if dt_bias is None else g_raw + dt_bias.to(g_raw.dtype)
    if A_log is not None:
        x = torch.exp(A_log.to(g_raw.dtype))[:, None] * x
    return lower_bound * torch.sigmoid(x)


def log_decay(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """The per-token log decay from ``g``: the lower-bound gate when ``lower_bound`` is set,
    the softplus gate when only ``A_log`` is, else ``g`` itself (already a log decay).

    g: [..., HV, K]. Returns [..., HV, K] in g's dtype.
    """
    if lower_bound is not None:
        return lower_bound_gate(g, A_log, dt_bias, lower_bound)
    if A_log is not None:
        return softplus_gate(g, A_log, dt_bias)
    return g


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def beta_transform(beta: torch.Tensor, use_sigmoid: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """Beta as used by the update: ``sigmoid(beta)`` when ``use_sigmoid``, times 2 with
    ``allow_neg_eigval`` (eigenvalues of the transition in (-1, 1))."""
    if use_sigmoid:
        beta = torch.sigmoid(beta)
    if allow_neg_eigval:
        beta = beta * 2.0
    return beta
