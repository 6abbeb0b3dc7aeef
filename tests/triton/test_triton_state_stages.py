"""The state pass launches with as many pipeline stages as fit (`state.launch_fitting`): a
compiled variant whose shared memory is over a block's limit raises OutOfResources as
Triton loads it, before it runs; the launcher then tries fewer stages, keeps the count
that fit for that variant and logs it once. Here the real kernel runs (interpreted without
CUDA) behind a launcher that refuses more than two stages as an H100/H200 refuses a block
over 227 KB; the results still meet the float64 reference, checkpoints included."""
from __future__ import annotations

import logging
from typing import Any

import pytest
from triton.runtime.errors import OutOfResources

import kernels.triton_backend as backend
from kernels.triton_kernels import state
from triton_cases import Case, check_checkpoints

LIMIT = 232448  # bytes a Hopper block may take
FITS = 2  # stages that fit in this test


class _SharedMemoryLimit:
    """`chunk_state_kernel` as a GPU loads it: a launch with more than ``fits`` stages raises
    OutOfResources before anything runs; the others launch the real kernel."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.fits = FITS
        self.stages: list[int] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, num_stages: int, **kwargs: Any) -> None:
            self.stages.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(LIMIT + 16384 * num_stages, LIMIT, "shared memory")
            self.kernel[grid](*args, num_stages=num_stages, **kwargs)
        return run


@pytest.fixture
def limited(monkeypatch: pytest.MonkeyPatch) -> _SharedMemoryLimit:
    """Three stages asked for by the config, two that fit, and no variant known yet."""
    real = backend.select_config
    monkeypatch.setattr(backend, "select_config", lambda K, V, interpret: real(K, V, interpret).with_overrides(
        state_stages=3))
    monkeypatch.setattr(state, "_STAGES_THAT_FIT", {})
    fake = _SharedMemoryLimit(state.chunk_state_kernel)
    monkeypatch.setattr(state, "chunk_state_kernel", fake)
    return fake


def test_a_variant_over_the_limit_falls_back_once_and_stays_correct(device: str, limited: _SharedMemoryLimit,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    case = Case((130, 64, 200), gate="lower_bound")
    with caplog.at_level(logging.INFO, logger=state.__name__):
        check_checkpoints(case, device, seed=31, tol=1e-4)
        first = list(limited.stages)  # one launch per level of segments (the checkpoints cut them)
        assert first[0] == 3 and len(first) > 1 and set(first[1:]) == {FITS}  # refused before it ran, then
        # launched with what fits, as every later launch of the variant is
        check_checkpoints(case, device, seed=32, tol=1e-4)
    assert set(limited.stages[len(first):]) == {FITS}  # the variant's count is kept: no second refusal
    fell_back = [r for r in caplog.records if "pipeline stages do not fit" in r.getMessage()]
    assert len(fell_back) == 1 and "launching it with 2" in fell_back[0].getMessage()


def test_one_stage_that_does_not_fit_is_an_error(device: str, limited: _SharedMemoryLimit) -> None:
    limited.fits = 0
    with pytest.raises(OutOfResources):
        check_checkpoints(Case((130,), gate="lower_bound"), device, seed=33, tol=1e-4)
    assert limited.stages == [3, 2, 1]
