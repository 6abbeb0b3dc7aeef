"""KDA (Kimi Delta Attention) prefill kernels.

`chunk_kda` updates an indexed state pool in place (SGLang's serving contract);
`kda_prefill` is the functional form. `naive_recurrent_kda` is the per-token oracle.
"""
from .api import chunk_kda, kda_prefill
from .backends import default_backend
from .gate import lower_bound_gate, softplus_gate
from .reference import naive_recurrent_kda

__all__ = [
    "chunk_kda",
    "kda_prefill",
    "default_backend",
    "naive_recurrent_kda",
    "softplus_gate",
    "lower_bound_gate",
]
