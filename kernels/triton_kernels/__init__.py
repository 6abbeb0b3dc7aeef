"""Triton kernels for KDA chunked prefill and decode, one module per stage:

- `gate`: device functions for the gate and beta transforms and the gate's chunk cumsum;
- `intra`: per-chunk gate cumsum, A_qk / A_kk and the triangular solve;
- `intra_bounded`: the same stage for the bounded gate with 16-bit inputs (`LaunchConfig.bounded_intra`);
- `wy`: the WY factors w, u (and kg, qg) from the solve;
- `state`: the sequential chunk-to-chunk state pass, in place on the pool;
- `output`: per-chunk outputs from the states and the intra-chunk matrices;
- `recurrent`: single-token sequences (decode), in place on the pool;
- `checks`: device functions that flag values as kernels load or store them (non-finite
  flags, a launch's input check);
- `extremes`: the value range of several tensors in one launch (the service's checks of
  inputs already on the GPU);
- `config`: fixed launch configurations by shape;
- `inputs`: what the stages' host launchers share (`StageInputs`, `StateTargets`).

Each stage's host launcher (`launch_intra`, `launch_wy`, ...) sits beside its kernel;
`kernels.triton_backend.run_triton` chains them.
"""
from .config import LaunchConfig, select_config
from .extremes import value_extremes
from .intra import chunk_intra_kernel
from .intra_bounded import chunk_intra_bounded_kernel
from .output import chunk_output_kernel
from .recurrent import recurrent_step_kernel
from .state import chunk_state_kernel
from .wy import chunk_wy_kernel

__all__ = [
    "LaunchConfig",
    "select_config",
    "chunk_intra_kernel",
    "chunk_intra_bounded_kernel",
    "chunk_wy_kernel",
    "chunk_state_kernel",
    "chunk_output_kernel",
    "recurrent_step_kernel",
    "value_extremes",
]
