"""KDA (Kimi Delta Attention) prefill kernels.

`chunk_kda` updates an indexed state pool in place (SGLang's serving contract);
`kda_prefill` is the functional form. Both check their arguments into a `PrefillProblem`;
`run_problem` runs one that its caller built and checked itself (the service, whose
validation already did). `naive_recurrent_kda` is the per-token oracle.
"""
from .api import chunk_kda, kda_prefill, run_problem
from .backends import default_backend
from .problem import PrefillProblem
from .reference import naive_recurrent_kda
from .transforms import lower_bound_gate, softplus_gate

__all__ = [
    "chunk_kda",
    "kda_prefill",
    "run_problem",
    "PrefillProblem",
    "default_backend",
    "naive_recurrent_kda",
    "softplus_gate",
    "lower_bound_gate",
]
