"""The package as built: a wheel from a copy of the checkout declares the SPDX license and
the Python floor the README states, ships ``py.typed`` for the typed packages, and the
build warns about nothing in pyproject.toml."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("kernels", "state_store", "service", "kda_client", "tensor_io")


def build_wheel(tmp_path: Path) -> tuple[Path, str]:
    """(the wheel, the build's output) built from a copy of the sources (the checkout is left clean)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return next((tmp_path / "dist").glob("kda_serve-*.whl")), done.stdout + done.stderr


def test_wheel_metadata_and_typed_packages(tmp_path: Path) -> None:
    wheel, output = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Python: >=3.11" in metadata
    assert {"kda_client/py.typed", "kernels/py.typed"} <= names
    assert not re.search(r"(BuildBackend|SetuptoolsDeprecation)Warning", output), output


def test_readme_states_the_python_floor() -> None:
    floor = PYPROJECT["project"]["requires-python"]
    assert floor == ">=3.11"
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python >= (3\.\d+)", readme))
    assert stated == {floor.removeprefix(">=")}, stated
    assert "'kda-serve[" not in readme  # not on PyPI: extras are installed from the checkout
