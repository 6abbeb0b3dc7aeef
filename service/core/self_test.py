"""Kernel self-test before ready: every compiled path the server launches, run once on small
fixed cases against the float64 reference (`kernels.naive_recurrent_kda`), on a scratch pool.

A toolchain can compile kernels that run, raise nothing and compute wrong numbers (a ptxas
newer than the driver leaving o unwritten; a ptxas miscompiling a fused kernel). So after
warm-up the server runs, for each input dtype it accepts (float32, bfloat16, float16) and
each gate mode (a given log decay; the softplus gate with A_log and dt_bias; the
lower-bound gate; each layer's server gate), one launch holding two one-token sequences
(the decode kernel) and two multi-chunk sequences (the chunked kernels), with q/k l2norm
and beta sigmoid where a gate is fused (the serving setup) and without them for the given
decay; on the GPU also a batch wide enough for the wide state pass and, where it fits, a
sequence long enough to run in pieces. Each path (`decode/bfloat16/lower_bound`, ...)
passes when o and the final states are within the project's tolerances of the reference
(relative L2: 1e-4 for fp32 inputs, 5e-3 for 16-bit inputs or a bf16 pool), each launch
writing its new states to spare rows as the server's do (`PrefillProblem.write_indices`),
every other pool row (the rows read too) untouched, bit for bit, and the kernels'
non-finite flags (`kernels.problem.PrefillProblem.nonfinite`) and their input check
(`input_checks`), passed as the server passes them, so the kernels compiled are the
server's, flag nothing.
One more launch per input dtype (`flags/<dtype>`) poisons v of a chunked sequence and q
of a decode sequence with a NaN: the flags must name exactly those two and the input check
must fail, or the server's transaction could not roll back.

A failure keeps the server unready; the `SelfTestReport` (in /info and the log) names each
failed path, its errors, and the toolchain that compiled it (`toolchain`).

``fault`` (the test-only setting ``--self-test-fault``) names one path whose o is corrupted
after its kernel ran (for a ``flags/`` path: whose flags are cleared), or, as
``check:PATH``, one whose input check is set on its finite inputs, to prove that a
mismatch keeps the server unready.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

import kernels
from kernels.problem import packed_problem
from state_store import PoolGeometry

from .gate_params import Gate
from .worker import as_on_the_device_thread

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NARROW = (1, 67, 1, 130)  # two decode sequences, two chunked ones (1 chunk + 3, 2 chunks + 2 tokens)
WIDE_SEQ_HEADS = 128  # sequence-heads from which the Triton state pass takes its wide form
MAX_PIECE_TOKENS = 16384  # a longer "pieces" case would make the reference too slow to run at start
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-3, torch.float16: 5e-3}
CHECK_FAULT = "check:"  # a fault of this prefix and a path: that path's input check fails its finite inputs
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Case:
    """One launch of the self-test: input ``dtype``, gate mode ``gate`` (a name), the gate
    itself, the kernel flags, and the sequence ``lengths`` packed in it."""

    dtype: torch.dtype
    gate: str
    params: Gate
    flags: bool  # q/k l2norm and beta sigmoid in kernel
    lengths: tuple[int, ...]
    layout: str = "narrow"

    def path(self, kind: str) -> str:
        """``kind/dtype/gate[/layout]``: how reports name a path."""
        suffix = "" if self.layout == "narrow" else f"/{self.layout}"
        return f"{kind}/{_NAMES[self.dtype]}/{self.gate}{suffix}"


@dataclass
class PathResult:
    """One path of one case: relative L2 errors of o and of the final states against the
    reference, the tolerance, and an error when the launch raised or stray rows changed."""

    path: str
    o_error: float = math.nan
    state_error: float = math.nan
    tolerance: float = 0.0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.o_error <= self.tolerance and self.state_error <= self.tolerance

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.path}: {self.error}"
        return (f"{self.path}: o error {self.o_error:.3g}, state error {self.state_error:.3g} "
                f"(tolerance {self.tolerance:g})")


@dataclass
class SelfTestReport:
    """Every path's result, the toolchain, and how long the test took."""

    results: list[PathResult]
    toolchain: dict[str, str]
    seconds: float = 0.0
    failures: list[PathResult] = field(init=False)

    def __post_init__(self) -> None:
        self.failures = [r for r in self.results if not r.ok]

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        tools = ", ".join(f"{k} {v}" for k, v in self.toolchain.items())
        if self.passed:
            return f"kernel self-test passed: {len(self.results)} paths in {self.seconds:.1f} s ({tools})"
        return (f"kernel self-test FAILED on {len(self.failures)} of {len(self.results)} paths: "
                + "; ".join(r.describe() for r in self.failures) + f". Compiled by: {tools}")

    def summary(self) -> dict[str, Any]:
        """The report as /info shows it."""
        return {
            "status": "passed" if self.passed else "failed",
            "paths": [r.path for r in self.results],
            "failures": [{"path": r.path, "detail": r.describe()} for r in self.failures],
            "toolchain": self.toolchain, "seconds": round(self.seconds, 3),
        }


def toolchain(backend: str, device: torch.device) -> dict[str, str]:
    """What compiled and runs the kernels: torch (and CUDA), the GPU, and for the Triton
    backend the triton version and the ptxas it compiles with (path and version), where
    they can be found."""
    info = {"backend": backend, "torch": torch.__version__}
    if device.type == "cuda":
        info["cuda"] = str(torch.version.cuda)
        info["gpu"] = torch.cuda.get_device_name(device)
    if backend == "triton":
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError as e:
            info["triton"] = f"not importable ({e})"
        if device.type == "cuda":
            info.update(_ptxas(device))
    return info


def _ptxas(device: torch.device) -> dict[str, str]:
    """The ptxas Triton uses for ``device`` (Triton >= 3.4's knobs; best effort)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        major, minor = torch.cuda.get_device_capability(device)
        tool = get_ptxas(major * 10 + minor)
        return {"ptxas": str(getattr(tool, "path", tool)), "ptxas_version": str(getattr(tool, "version", "unknown"))}
    except Exception as e:  # a Triton without these internals: say so, never fail the test for it
        return {"ptxas": f"unknown ({type(e).__name__}: {e})"}


def cases(geometry: PoolGeometry, backend: str, gates: Mapping[int, Gate]) -> list[Case]:
    """The launches that cover what this server compiles (see the module docstring)."""
    HV, K = geometry.num_heads, geometry.head_k_dim
    gen = torch.Generator().manual_seed(1234)
    request_gates = {
        "given": (Gate(), False),
        "softplus": (Gate(A_log=torch.randn(HV, generator=gen) * 0.5,
                          dt_bias=torch.randn(HV, K, generator=gen) * 0.5), True),
        "lower_bound": (Gate(A_log=torch.randn(HV, generator=gen) * 0.5,
                             dt_bias=torch.randn(HV, K, generator=gen) * 0.5, lower_bound=-5.0), True),
    }
    request_gates.update({f"server-layer-{layer}": (gate, True) for layer, gate in sorted(gates.items())})
    out = [Case(dtype, name, gate, flags, NARROW)
           for dtype, (name, (gate, flags)) in itertools.product(INPUT_DTYPES, request_gates.items())]
    if backend == "triton" and geometry.device.type == "cuda":
        serving, flags = request_gates["lower_bound"]
        wide = (1, *[65] * max(2, -(-WIDE_SEQ_HEADS // HV)))
        out += [Case(dtype, "lower_bound", serving, flags, wide, "wide") for dtype in INPUT_DTYPES]
        piece = _piece_tokens(geometry)
        if piece is not None:
            out.append(Case(torch.bfloat16, "lower_bound", serving, flags, (1, piece), "pieces"))
    return out


def _piece_tokens(geometry: PoolGeometry) -> Optional[int]:
    """Tokens of one sequence that the Triton backend runs in two pieces, or None when
    it never splits one, or only beyond `MAX_PIECE_TOKENS`."""
    from kernels.problem import CHUNK_SIZE
    from kernels.triton_kernels import select_config
    from kernels.triton_kernels.config import piece_chunks

    per_piece = piece_chunks(select_config(geometry.head_k_dim, geometry.head_v_dim, False), geometry.num_heads, 1)
    tokens = CHUNK_SIZE * per_piece + 3
    return tokens if 0 < per_piece and tokens <= MAX_PIECE_TOKENS else None


@dataclass(frozen=True)
class _Fixture:
    """What every input dtype of one (gate, layout) shares: the inputs q, k, v, g, beta
    ([T, ...] float32 on the host, each value exact in float32, bfloat16 and float16, so
    one reference serves them all), the scratch pool's starting rows ([2N + 3, HV, V, K] in
    the pool dtype, on the device), the rows the sequences read and the spare rows they
    write their new states to (as the server's launches do), and the float64 reference o
    [T, HV, V] and final states [N, HV, V, K] (host)."""

    inputs: tuple[torch.Tensor, ...]
    pool: torch.Tensor
    rows: torch.Tensor
    written: torch.Tensor
    bounds: list[int]
    ref_o: torch.Tensor
    ref_h: torch.Tensor


def _fixture(case: Case, geometry: PoolGeometry, seed: int) -> _Fixture:
    """Random inputs for ``case``'s gate and layout: never zero; k scaled so the
    recurrence stays tame without l2norm; g a log decay < 0 for the given gate, raw for
    fused ones; beta in (0, 1), or logits with the sigmoid. Then the reference."""
    HV, K, V, device = geometry.num_heads, geometry.head_k_dim, geometry.head_v_dim, geometry.device
    gen = torch.Generator().manual_seed(seed)
    N, T = len(case.lengths), sum(case.lengths)
    q = torch.randn(T, HV, K, generator=gen)
    k = torch.randn(T, HV, K, generator=gen) / math.sqrt(K)
    v = torch.randn(T, HV, V, generator=gen)
    g = torch.randn(T, HV, K, generator=gen)
    if case.gate == "given":
        g = -F.softplus(g - 2.0)
    beta = torch.randn(T, HV, generator=gen) if case.flags else torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    inputs = tuple(t.to(torch.bfloat16).to(torch.float16).float() for t in (q, k, v, g, beta))  # exact in all three
    rows, written = torch.randperm(2 * N + 3, generator=gen)[:2 * N].split(N)
    pool = (torch.randn(2 * N + 3, *geometry.slot_shape[1:], generator=gen) * 0.3).to(device=device,
                                                                                     dtype=geometry.dtype)
    bounds = [0, *itertools.accumulate(case.lengths)]
    gate = case.params
    ref_o, ref_h = kernels.naive_recurrent_kda(  # on the device: thousands of small steps
        *(t.to(device) for t in inputs), initial_state=pool[rows.to(device)], cu_seqlens=bounds,
        A_log=None if gate.A_log is None else gate.A_log.to(device),
        dt_bias=None if gate.dt_bias is None else gate.dt_bias.to(device), lower_bound=gate.lower_bound,
        use_qk_l2norm=case.flags, use_beta_sigmoid=case.flags)
    return _Fixture(inputs, pool, rows, written, bounds, ref_o.cpu(), ref_h.cpu())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(case: Case, fixture: _Fixture, geometry: PoolGeometry, backend: str,
             fault: Optional[str] = None) -> list[PathResult]:
    """Launch ``case`` on a copy of the fixture's scratch pool and compare each of its
    paths (decode: the one-token sequences, chunked: the others) with the reference."""
    device, lengths, bounds = geometry.device, case.lengths, fixture.bounds
    kinds = {"decode": [i for i, n in enumerate(lengths) if n == 1],
             "chunked": [i for i, n in enumerate(lengths) if n > 1]}
    tol = max(TOLERANCE[case.dtype], TOLERANCE[torch.bfloat16] if geometry.dtype == torch.bfloat16 else 0.0)
    results = {kind: PathResult(case.path(kind), tolerance=tol) for kind, seqs in kinds.items() if seqs}
    pool, rows, written, gate = fixture.pool.clone(), fixture.rows.to(device), fixture.written.to(device), case.params
    try:
        problem = packed_problem(  # as `ServerCore._launch` builds and runs it
            *(t.to(device=device, dtype=case.dtype) for t in fixture.inputs), bounds=bounds, pool=pool,
            indices=rows, scale=None, A_log=None if gate.A_log is None else gate.A_log.to(device),
            dt_bias=None if gate.dt_bias is None else gate.dt_bias.to(device), lower_bound=gate.lower_bound,
            use_qk_l2norm=case.flags, use_beta_sigmoid=case.flags, allow_neg_eigval=False,
            nonfinite=torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device),
            input_checks=torch.zeros(1, dtype=torch.int32, device=device), write_indices=written,
        )
        o, _ = kernels.run_problem(problem, backend)
        flagged = problem.nonfinite.tolist()
        inputs_failed = bool(problem.input_checks.item())
        for kind, seqs in kinds.items():
            if seqs and fault == case.path(kind):
                for n in seqs:
                    o[bounds[n]:bounds[n + 1]] += 1.0  # the injected fault: this path's o is wrong
        check_failed = {kind: inputs_failed or fault == CHECK_FAULT + case.path(kind) for kind in kinds}  # or injected
        o, finals, after = o.cpu(), pool.index_select(0, written).cpu(), pool.cpu()
    except Exception as e:  # a kernel that fails to compile or launch fails its paths
        for result in results.values():
            result.error = f"launch raised {type(e).__name__}: {str(e)[:300]}"
        return list(results.values())
    stray = [r for r in range(pool.shape[0]) if r not in set(fixture.written.tolist())]  # the rows read too
    untouched = torch.equal(after[stray], fixture.pool.cpu()[stray])
    for kind, seqs in kinds.items():
        if not seqs:
            continue
        tokens = torch.cat([torch.arange(bounds[n], bounds[n + 1]) for n in seqs])
        result = results[kind]
        result.o_error = _rel(o[tokens], fixture.ref_o[tokens])
        result.state_error = _rel(finals[seqs], fixture.ref_h[seqs])
        if not untouched:
            result.error = "the launch wrote pool rows other than those it was to write its new states to"
        elif any(flagged):
            result.error = f"the kernels flagged finite results as non-finite (flags {flagged})"
        elif check_failed[kind]:
            result.error = "the kernels' input check failed finite inputs (every request would be refused)"
    return list(results.values())


FLAG_POISON = {2: 1, 0: 2}  # input (2: v, 0: q, in q, k, v, g, beta order) -> the NARROW sequence it poisons


def run_flag_case(dtype: torch.dtype, fixture: _Fixture, geometry: PoolGeometry, backend: str,
                  fault: Optional[str] = None) -> PathResult:
    """``flags/<dtype>``: the NARROW lower-bound case with one NaN in v of its chunked
    sequence 1 and one in q of its decode sequence 2: the flags must be set for exactly
    those two (the output stage may add the unattributed flag [N])."""
    device, bounds = geometry.device, fixture.bounds
    result = PathResult(f"flags/{_NAMES[dtype]}")
    inputs = [t.to(device=device, dtype=dtype) for t in fixture.inputs]  # q, k, v, g, beta
    for which, n in FLAG_POISON.items():
        inputs[which][(bounds[n] + bounds[n + 1]) // 2, 0, 0] = float("nan")
    gate = Gate(A_log=torch.zeros(geometry.num_heads), dt_bias=None, lower_bound=-5.0)
    try:
        problem = packed_problem(
            *inputs, bounds=bounds, pool=fixture.pool.clone(), indices=fixture.rows.to(device),
            write_indices=fixture.written.to(device), scale=None,
            A_log=gate.A_log.to(device), dt_bias=None, lower_bound=gate.lower_bound, use_qk_l2norm=True,
            use_beta_sigmoid=True, allow_neg_eigval=False,
            nonfinite=torch.zeros(len(bounds), dtype=torch.int32, device=device),
            input_checks=torch.zeros(1, dtype=torch.int32, device=device))
        kernels.run_problem(problem, backend)
        if fault == result.path:  # the injected fault: kernels that never flag, nor check their inputs
            problem.nonfinite.zero_()
            problem.input_checks.zero_()
        flagged = problem.nonfinite.tolist()
        inputs_failed = bool(problem.input_checks.item())
    except Exception as e:
        result.error = f"launch raised {type(e).__name__}: {str(e)[:300]}"
        return result
    result.o_error = result.state_error = 0.0
    expected = [int(n in FLAG_POISON.values()) for n in range(len(bounds) - 1)]
    errors = []
    if flagged[:-1] != expected:
        errors.append(f"the kernels' non-finite flags are {flagged}, expected {expected} (+ the unattributed one)")
    if not inputs_failed:
        errors.append("the kernels' input check passed a NaN in q and in v (bad requests would change slots)")
    result.error = "; ".join(errors) or None
    return result


def _run_cases(geometry: PoolGeometry, backend: str, gates: Mapping[int, Gate],
               fault: Optional[str]) -> list[PathResult]:
    """`run_self_test`'s results: every case of `cases`, then the flag cases."""
    fixtures: dict[tuple[str, str], _Fixture] = {}
    results: list[PathResult] = []
    for case in cases(geometry, backend, gates):
        key = (case.gate, case.layout)
        if key not in fixtures:
            fixtures[key] = _fixture(case, geometry, seed=len(fixtures))
        results += run_case(case, fixtures[key], geometry, backend, fault)
    narrow = fixtures.get(("given", "narrow"))
    if narrow is not None:
        results += [run_flag_case(dtype, narrow, geometry, backend, fault) for dtype in INPUT_DTYPES]
    return results


def run_self_test(geometry: PoolGeometry, backend: str, gates: Mapping[int, Gate],
                  fault: Optional[str] = None) -> SelfTestReport:
    """Every case of `cases`, in order (on the device thread: it launches kernels); the report."""
    start = time.perf_counter()
    results = as_on_the_device_thread(geometry.device, _run_cases, geometry, backend, gates, fault)
    if fault is not None and fault.removeprefix(CHECK_FAULT) not in {r.path for r in results}:  # proves nothing
        results.append(PathResult(fault, error="--self-test-fault names no path of this server's self-test"))
    if geometry.device.type == "cuda":
        torch.cuda.synchronize(geometry.device)
    return SelfTestReport(results, toolchain(backend, geometry.device), time.perf_counter() - start)
