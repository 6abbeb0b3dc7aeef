"""First contact with ``kda-serve`` (the installed console script, in a subprocess on
127.0.0.1): a bad value of any flag, or of its KDA_* variable, is refused at start with exit
status 2, a last line on stderr that names the setting and the value, and no traceback; and
README's flag list is the one ``--help`` gives."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

import pytest
import torch
from server_harness import ROOT

from service.config import Settings, _field_types, build_parser

KDA_SERVE = Path(sys.executable).parent / "kda-serve"
TOY = ["--device", "cpu", "--num-layers", "1", "--num-slots", "4", "--num-heads", "1", "--head-dim", "2"]
FLOAT_FIELDS = [name for name, kind in _field_types(Settings).items() if kind is float]


def kda_serve(args: Sequence[str], env: Optional[Mapping[str, str]] = None,
              timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the console script on an ephemeral loopback port; a start that is not refused
    within ``timeout`` fails the test (the child is killed)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KDA_") and k != "TRITON_INTERPRET"}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    try:
        return subprocess.run([str(KDA_SERVE), "--host", "127.0.0.1", "--port", "0", *TOY, *args], cwd=ROOT,
                              env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"kda-serve {' '.join(args)} was not refused: it was still running after {timeout} s\n{e.stderr}")


def assert_refused(done: subprocess.CompletedProcess[str], why: str) -> str:
    """Exit 2, no traceback, never listening; the last line on stderr is ``kda-serve: ...``
    and matches ``why``. That line."""
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "listening on" not in done.stdout, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kda-serve: ") and re.search(why, last), last
    return last


def names(field: str) -> str:
    """A pattern for the setting ``field`` as the field, the flag or the variable names it."""
    return rf"({field}|--{field.replace('_', '-')}|KDA_{field.upper()})"


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_an_infinite_float_flag_is_refused_naming_the_flag(field: str) -> None:
    done = kda_serve([f"--{field.replace('_', '-')}", "inf"])
    assert_refused(done, rf"{names(field)} must be finite, got inf")


def test_an_infinite_float_variable_is_refused_as_the_flag_is() -> None:
    assert_refused(kda_serve([], env={"KDA_MAX_BODY_MB": "inf"}), rf"{names('max_body_mb')} must be finite, got inf")


def test_an_unknown_log_level_is_refused_as_a_usage_error() -> None:
    assert_refused(kda_serve(["--log-level", "bogus"]), rf"{names('log_level')} must be one of .*got 'bogus'")
    assert_refused(kda_serve([], env={"KDA_LOG_LEVEL": "verbose"}), rf"{names('log_level')} .*got 'verbose'")


def test_an_empty_host_is_refused_instead_of_listening_on_every_interface() -> None:
    done = kda_serve(["--host", ""])  # the last --host wins
    assert_refused(done, rf"{names('host')} must not be empty")


@pytest.mark.parametrize("first, second", [("port", "metrics_port"), ("port", "grpc_port"),
                                           ("grpc_port", "metrics_port")])
def test_two_endpoints_on_one_port_are_refused_naming_both_flags(first: str, second: str) -> None:
    port = "18931"  # never bound: the conflict is refused before any port is
    done = kda_serve([f"--{first.replace('_', '-')}", port, f"--{second.replace('_', '-')}", port])
    assert_refused(done, rf"{names(first)} and {names(second)} must differ, both are {port}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_on_a_machine_without_one_is_refused_in_one_line(device: str) -> None:
    done = kda_serve(["--device", device])
    line = assert_refused(done, rf"--device {device}: no CUDA device is visible")
    assert done.stderr.strip() == line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_triton_backend_on_the_cpu_is_refused_in_one_line() -> None:
    done = kda_serve(["--backend", "triton"])  # else it listens, its warm-up fails and it is never ready
    line = assert_refused(done, r"--backend triton cannot run on cpu")
    assert done.stderr.strip() == line


@pytest.mark.parametrize("flags", [["--num-slots", str(10**12)], ["--spare-rows", str(10**12)]])
def test_a_pool_too_large_for_memory_is_refused_in_one_line(flags: list[str]) -> None:
    """Before its host bookkeeping is allocated (a numpy MemoryError traceback once)."""
    done = kda_serve(flags)
    line = assert_refused(done, r"pool of shape .*1000000000000.* needs \d+ bytes .* available")
    assert done.stderr.strip() == line


README = (ROOT / "README.md").read_text()
FLAGS_PARAGRAPH = README[README.index("\nFlags: `"):README.index("With no flags:")]


def test_the_readme_flag_list_is_the_help_flag_list() -> None:
    parser = build_parser({})
    in_help = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    in_readme = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", FLAGS_PARAGRAPH))
    assert in_help - in_readme == set(), "flags --help lists that README's flag list lacks"
    assert in_readme - in_help == set(), "flags README lists that --help lacks"

