"""`kda_client` at its edges, against one live kda-serve on 127.0.0.1:

- a shared memory region the client cannot size (``ftruncate`` refused) leaves no file in
  /dev/shm, and the client's next prefill still works;
- an error in the Open Inference Protocol's form (``{"error": msg}``, what the ``/v2``
  routes a ``transport="cuda"`` client registers its region with answer) raises with its
  message as the problem's ``detail``, sync and async (before: ``"400 : "``, no detail);
- a tensor with no token dimension (0-d) is a ValueError on every encoding and transport
  (before: IndexError, or the server's 400 on some), and a 0-d ``A_log`` the server's 400
  naming it on every one (before: IndexError over shared memory).
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import zlib
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from kda_client import AsyncKDAClient, BadRequest, KDAClient, PoolFullError, StateLost
from kda_client.shm import Registration
from server_harness import (  # noqa: F401  (one_torch_thread: autouse for this module)
    GEOMETRY_ARGS, TOL, Server, kill_9, make_sequence, one_torch_thread, reference, rel, start_server,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(GEOMETRY_ARGS, tmp_path_factory.mktemp("review") / "kda.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


CLIENTS = [dict(), dict(encoding="json"), dict(transport="shm")]
CLIENT_IDS = ["safetensors", "json", "shm"]


def _shm_files() -> set[str]:
    """This process's files in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kda-{os.getpid()}-")}


@contextmanager
def _files_limited_to(nbytes: int) -> Iterator[None]:
    """No file of this process may grow past ``nbytes`` inside the block (RLIMIT_FSIZE, with
    SIGXFSZ ignored: the system call fails with EFBIG instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# -- shared memory: nothing left behind ----------------------------------------------------

def test_a_region_that_cannot_be_sized_leaves_no_file_and_the_next_prefill_works(server, gen) -> None:
    seq = make_sequence(5, gen)
    with KDAClient(server.url, transport="shm") as c:
        c.info()  # the connection made before the limit
        with _files_limited_to(1 << 16), pytest.raises(OSError) as refused:
            c.prefill(0, [(None, *seq)])  # every region is at least 1 MiB
        assert refused.value.errno == errno.EFBIG
        assert not _shm_files()
        out = c.prefill(0, [(None, *seq)])
        o, final = reference([seq])
        assert rel(out.o_packed, o) < TOL and rel(out.final_state, final) < TOL
        c.free(out.slots[0])
    assert not _shm_files()


# -- errors ----------------------------------------------------------------------------------

def _cuda_registration() -> Registration:
    """A CUDA IPC region's registration as `kda_client.shm.CudaArena` makes it (this
    server has no CUDA device: it refuses it, in the Open Inference Protocol's form)."""
    handle = "A" * 88  # base64 of 64 zero bytes, a cudaIpcMemHandle_t's size
    return Registration("/v2/cudasharedmemory/region/review/register",
                        {"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 1 << 20, "ttl_s": 30.0})


def _assert_oip_refusal_kept_its_message(e: BadRequest) -> None:
    assert e.status == 400 and e.problem["status"] == 400
    assert "needs a CUDA device" in e.problem["detail"] and "needs a CUDA device" in str(e)


def test_an_oip_error_body_keeps_its_message(server) -> None:
    with KDAClient(server.url) as c:
        with pytest.raises(BadRequest) as refused:
            c._run(c._calls.register_region(_cuda_registration()))
    _assert_oip_refusal_kept_its_message(refused.value)


def test_an_oip_error_body_keeps_its_message_async(server) -> None:
    async def refused() -> BadRequest:
        async with AsyncKDAClient(server.url) as c:
            with pytest.raises(BadRequest) as e:
                await c._run(c._calls.register_region(_cuda_registration()))
            return e.value

    _assert_oip_refusal_kept_its_message(asyncio.run(refused()))


# -- inputs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("position", range(5), ids=["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("kw", CLIENTS, ids=CLIENT_IDS)
def test_a_tensor_without_a_token_dimension_is_a_value_error_on_every_path(server, gen, kw: dict[str, Any],
                                                                           position: int) -> None:
    seq = list(make_sequence(1, gen))
    seq[position] = seq[position].reshape(-1)[0]  # 0-d
    with KDAClient(server.url, **kw) as c:
        free = c.info()["free_slots"]
        with pytest.raises(ValueError, match="token dimension"):
            c.prefill(0, [(None, *seq)])
        assert c.info()["free_slots"] == free
    assert not _shm_files()


@pytest.mark.parametrize("kw", CLIENTS, ids=CLIENT_IDS)
def test_a_0d_a_log_is_the_servers_400_naming_it_on_every_path(server, gen, kw: dict[str, Any]) -> None:
    seq = make_sequence(2, gen, raw_gate=True)
    with KDAClient(server.url, **kw) as c:
        with pytest.raises(BadRequest) as refused:
            c.prefill(0, [(None, *seq)], A_log=torch.randn((), generator=gen))
    assert refused.value.status == 400 and refused.value.problem["field"] == "A_log"
    assert not _shm_files()


# -- 503: when to come back, on every transport ----------------------------------------------

def test_a_full_pool_says_when_to_retry_over_http_and_the_framed_socket(tmp_path, gen) -> None:
    """PoolFullError carries ``retry_after`` over HTTP (the Retry-After header) and over the
    framed socket, whose replies have no headers (the problem's ``retry_after`` member);
    nothing is allocated."""
    path = str(tmp_path / "kda.sock")
    srv = start_server([*GEOMETRY_ARGS, "--num-slots", "3", "--framed-socket", path], tmp_path / "kda.log")
    try:
        sequences = [(None, *make_sequence(n, gen)) for n in (3, 2)]  # two new slots, one free
        with KDAClient(srv.url) as owner:
            owner.alloc(2)
        for kw in (dict(), dict(transport="shm"), dict(transport="shm", framed_socket=path)):
            with KDAClient(srv.url, **kw) as client:
                with pytest.raises(PoolFullError) as full:
                    client.prefill(0, sequences)
                assert full.value.retry_after == 1.0, (kw, full.value.problem)
                assert full.value.problem["retry_after"] == 1, kw
                assert client.info()["used_slots"] == 2, kw
    finally:
        assert srv.stop() == 0, srv.log_text()


# -- 409 state_lost: its own class -------------------------------------------------------------

def test_a_slot_flagged_state_lost_raises_state_lost_naming_it(tmp_path, gen) -> None:
    """A slot that advanced after the last snapshot of a server killed with -9 comes back
    flagged ``state_lost``: a prefill on it raises `StateLost` (a BadRequest, 409) naming the
    slot, and changes nothing; after `put_state` it serves again."""
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(tmp_path / "pool.snapshot")]
    first = start_server(args, tmp_path / "first.log")
    with KDAClient(first.url) as client:
        slot = client.alloc()[0]
    assert first.stop() == 0, first.log_text()  # the clean stop's snapshot holds the slot
    second = start_server(args, tmp_path / "second.log")
    with KDAClient(second.url) as client:
        client.prefill(0, [(slot, *make_sequence(5, gen))])  # advances after that snapshot
    kill_9(second)
    third = start_server(args, tmp_path / "third.log")
    try:
        with KDAClient(third.url) as client:
            before = client.get_state(slot)
            with pytest.raises(StateLost) as lost:
                client.prefill(0, [(slot, *make_sequence(3, gen))])
            assert isinstance(lost.value, BadRequest) and lost.value.status == 409
            assert lost.value.slot == slot
            assert torch.equal(client.get_state(slot), before) and client.slot_info(slot)["state_lost"]
            client.put_state(slot, torch.zeros_like(before))
            chunk = make_sequence(4, gen)
            out = client.prefill(0, [(slot, *chunk)])
            assert rel(out.final_state[0], reference([chunk])[1][0]) < TOL
    finally:
        assert third.stop() == 0, third.log_text()


@pytest.mark.parametrize("key", ["sesame\r\nX-Injected: 1", "ses\name", "ses\x00ame", "ses\tame"])
@pytest.mark.parametrize("cls", [KDAClient, AsyncKDAClient])
def test_an_api_key_with_a_control_character_is_refused_before_any_request(server, key: str, cls: Any) -> None:
    """A key no header can carry is a ValueError at construction (the small-request path
    writes headers by hand: CR LF in the key would have added a header of the caller's)."""
    with pytest.raises(ValueError, match="control character"):
        cls(server.url, api_key=key)
