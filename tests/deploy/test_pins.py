"""The pins agree: the Docker base image's torch, triton and CUDA are the ones the Dockerfile
and the README name and pyproject.toml's ranges admit; constraints.txt pins every other
dependency (runtime and the grpc and ray extras) at a version pyproject.toml admits, from
CI's Python; the Dockerfile installs with it and takes the extras as a build argument."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
README = (ROOT / "README.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FROM_BASE = {"torch", "triton"}  # the image's base provides them


def base_image() -> str:
    found = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, flags=re.MULTILINE)
    assert len(found) == 1, found
    return found[0]


def base_stack() -> dict[str, str]:
    """torch, triton and CUDA versions of the base: the tag gives torch and CUDA, the
    Dockerfile's comment the triton it bundles."""
    tag = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", base_image())
    assert tag, base_image()
    stated = re.search(r"torch (\d+\.\d+), triton (\d+\.\d+) and CUDA (\d+\.\d+)", DOCKERFILE)
    assert stated, "the Dockerfile names the base's torch, triton and CUDA"
    assert tag[1].startswith(stated[1] + ".") and tag[2] == stated[3], (tag.groups(), stated.groups())
    return {"torch": tag[1], "triton": stated[2] + ".0", "cuda": tag[2]}


def requirements(extras: tuple[str, ...] = ()) -> list[Requirement]:
    lines = list(PROJECT["dependencies"])
    for extra in extras:
        lines += PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and name == canonicalize_name(name), line
            pins[name] = version
    return pins


def test_the_base_image_is_the_stack_the_gpu_tests_ran_on_and_pyproject_admits_it() -> None:
    stack = base_stack()
    assert stack == {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0"}  # the H200's
    ranges = {r.name: r.specifier for r in requirements()}
    assert ranges["torch"].contains(stack["torch"]) and ranges["triton"].contains(stack["triton"])


def test_the_readme_names_the_same_base() -> None:
    stack = base_stack()
    assert f"`{base_image()}`" in README
    minor = ".".join(stack["torch"].split(".")[:2])
    assert f"torch {minor}, triton {stack['triton'][:-2]} and CUDA {stack['cuda']}" in README


def test_constraints_pin_every_dependency_within_pyproject_ranges() -> None:
    pins = constraints()
    assert not FROM_BASE & set(pins) and not any(n.startswith("nvidia-") for n in pins)
    for req in requirements(("grpc", "ray")):
        name = canonicalize_name(req.name)
        if name in FROM_BASE:
            continue
        assert name in pins, f"constraints.txt does not pin {name}"
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])


def test_constraints_come_from_cis_python() -> None:
    header = (ROOT / "constraints.txt").read_text().splitlines()[1]
    floor = PROJECT["requires-python"].removeprefix(">=")
    assert re.search(rf"\(Python {re.escape(floor)}\.\d+, torch [^)]+\)", header), header


def test_the_image_installs_with_the_constraints_and_takes_the_extras_as_an_argument() -> None:
    assert re.search(r"^COPY pyproject\.toml constraints\.txt \./$", DOCKERFILE, flags=re.MULTILINE)
    assert "pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt" in DOCKERFILE
    assert re.search(r'^ARG EXTRAS=""$', DOCKERFILE, flags=re.MULTILINE)
    for named in re.findall(r"--build-arg EXTRAS=([\w,]+)", DOCKERFILE + README):
        assert set(named.split(",")) <= set(PROJECT["optional-dependencies"]), named


def test_freeze_script_writes_pins_and_leaves_the_base_out() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "freeze_constraints.py"), "-o", "-"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    names = {line.split("==")[0] for line in lines}
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", line) for line in lines), lines
    assert "fastapi" in names and "uvicorn" in names and not names & (FROM_BASE | {"kda-serve", "pip"})
