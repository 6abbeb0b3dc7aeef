"""The ptxas choice of `kernels.triton_toolchain` (pure function; fake ptxas binaries that
print a release, no GPU): on Hopper the first system ptxas of CUDA >= 13.0 and <= the
driver's; a caller's TRITON_PTXAS_PATH kept; other GPUs and no candidate: Triton's own."""
from __future__ import annotations

import stat
from pathlib import Path

from kernels.triton_toolchain import PTXAS_ENV, choose_ptxas


def fake_cuda(root: Path, release: str) -> str:
    """A CUDA folder whose bin/ptxas prints ``release`` as nvcc's tools do."""
    ptxas = root / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    ptxas.chmod(ptxas.stat().st_mode | stat.S_IEXEC)
    return str(root)


def test_hopper_takes_a_cuda_13_ptxas_not_newer_than_the_driver(tmp_path: Path) -> None:
    old = fake_cuda(tmp_path / "c12", "12.8")
    new = fake_cuda(tmp_path / "c130", "13.0")
    newer = fake_cuda(tmp_path / "c135", "13.5")
    chosen = choose_ptxas((9, 0), {"CUDA_HOME": newer, "CUDA_PATH": new}, driver=(13, 0))
    assert chosen.ptxas == f"{new}/bin/ptxas" and chosen.release == (13, 0)
    assert choose_ptxas((9, 0), {"CUDA_HOME": newer}, driver=(13, 5)).release == (13, 5)
    bundled = choose_ptxas((9, 0), {"CUDA_HOME": old, "CUDA_PATH": newer}, driver=(13, 0))
    if bundled.ptxas is not None:  # only a real /usr/local/cuda of CUDA 13.0 may be taken
        assert bundled.ptxas == "/usr/local/cuda/bin/ptxas" and bundled.release == (13, 0)
    else:
        assert "bundled" in bundled.reason


def test_callers_choice_and_other_gpus_are_left_alone(tmp_path: Path) -> None:
    new = fake_cuda(tmp_path / "c130", "13.0")
    mine = f"{fake_cuda(tmp_path / 'mine', '12.8')}/bin/ptxas"
    kept = choose_ptxas((9, 0), {PTXAS_ENV: mine, "CUDA_HOME": new}, driver=(13, 0))
    assert kept.ptxas == mine and kept.release == (12, 8) and "caller" in kept.reason
    ampere = choose_ptxas((8, 0), {"CUDA_HOME": new}, driver=(13, 0))
    assert ampere.ptxas is None and "bundled" in ampere.reason
