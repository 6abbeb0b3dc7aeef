"""A closed `kda_client` client refuses every call, against one live kda-serve (with a
framed socket), for `KDAClient` (`close`, or the end of its ``with`` block) and
`AsyncKDAClient` (`aclose`, ``async with``) alike:

- every public call raises `ClientClosed` ("the client is closed") before anything is
  sent: the server counts no request (HTTP or framed) and its pool is unchanged, on
  every encoding and transport (before: the HTTP calls went out on fresh connections);
- a shared memory prefill after close registers no region (before: it registered one it
  never unregistered): none in the server's registry (``/shm/regions`` and KServe's
  ``/v2/systemsharedmemory/status``), none in /dev/shm;
- a prepared prefill made before close refuses `run` with the same error; its `release`,
  like a second `close`, does nothing and sends nothing.
"""
from __future__ import annotations

import asyncio
import os
import zlib
from contextlib import nullcontext
from typing import Any, Awaitable, Callable, Iterator

import httpx
import pytest
import torch

from kda_client import AsyncKDAClient, ClientClosed, KDAClient
from server_harness import (  # noqa: F401  (one_torch_thread: autouse for this module)
    GEOMETRY_ARGS, HV, K, LAYERS, V, Server, make_sequence, one_torch_thread, pool_image, start_server,
)

pytestmark = pytest.mark.timeout(120)

CLOSED = "^the client is closed$"


@pytest.fixture(scope="module")
def framed(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("closed-sock") / "kda.sock")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, framed: str) -> Iterator[Server]:
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", framed], tmp_path_factory.mktemp("closed") / "kda.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


TRANSPORTS = ["http", "json", "shm", "framed"]


def _options(transport: str, framed: str) -> dict[str, Any]:
    """The client arguments of each transport: binary HTTP, JSON HTTP, shared memory over
    HTTP, shared memory over the framed socket."""
    return {"http": {}, "json": {"encoding": "json"}, "shm": {"transport": "shm"},
            "framed": {"transport": "shm", "framed_socket": framed}}[transport]


# -- what the server saw --------------------------------------------------------------------

def _served(server: Server) -> float:
    """Requests the server has answered: HTTP (its /metrics scrapes aside) and framed."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        http = sample.startswith("kda_http_requests_total{") and 'route="/metrics"' not in sample
        if http or sample.startswith("kda_framed_requests_total{"):
            total += float(value)
    return total


def _mine(server: Server) -> set[str]:
    """This process's regions in the server's registry, as both its routes list them."""
    listed = httpx.get(f"{server.url}/shm/regions").json() + \
        httpx.get(f"{server.url}/v2/systemsharedmemory/status").json()
    return {r["name"] for r in listed if r["name"].startswith(f"kda-{os.getpid()}-")}


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kda-{os.getpid()}-")}


@pytest.fixture
def clean(server: Server) -> Iterator[None]:
    """No region of this process before the test; none left after it (cleared for the next)."""
    assert not _mine(server) and not _shm_files()
    yield
    left = _mine(server)
    for name in left:
        httpx.delete(f"{server.url}/shm/regions/{name}")
    assert not left and not _shm_files()


class _Unchanged:
    """Around calls that must send nothing: the server served no request, its pool (the
    ``slots``' states and token counts, the free slot count) is as it was, and no region of
    ours is registered or in /dev/shm."""

    def __init__(self, server: Server, *slots: str) -> None:
        self.server, self.slots = server, slots

    def __enter__(self) -> None:
        self.image = pool_image(self.server.url, self.slots)
        self.served = _served(self.server)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            return
        assert _served(self.server) == self.served, "a call on a closed client reached the server"
        assert pool_image(self.server.url, self.slots) == self.image
        assert not _mine(self.server) and not _shm_files()


def _alloc(server: Server, count: int = 1) -> list[str]:
    with KDAClient(server.url) as other:
        return other.alloc(count)


def _free(server: Server, *slots: str) -> None:
    with KDAClient(server.url) as other:
        for slot in slots:
            other.free(slot)


# -- every call -----------------------------------------------------------------------------

def _calls(c: Any, slot: str, seq: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], Any]]:
    """Every public call of client ``c`` but its close, by method name (the async client's
    give coroutines): each would change or read ``slot``, the pool or the prefix cache.
    ``c`` may be the class, to list the names."""
    state = torch.zeros(LAYERS, HV, V, K)
    return {
        "alloc": lambda: c.alloc(1),
        "alloc(prefix)": lambda: c.alloc(1, prefix=["closed/key"]),
        "publish": lambda: c.publish(slot, "closed/key"),
        "prefix_info": lambda: c.prefix_info("closed/key"),
        "drop_prefix": lambda: c.drop_prefix("closed/key"),
        "free": lambda: c.free(slot),
        "fork": lambda: c.fork(slot),
        "slot_info": lambda: c.slot_info(slot),
        "get_state": lambda: c.get_state(slot),
        "put_state": lambda: c.put_state(slot, state),
        "info": c.info,
        "ready": c.ready,
        "prefill": lambda: c.prefill(0, [(slot, *seq)]),
        "prefill(new slot)": lambda: c.prefill(0, [(None, *seq)]),
        "prepare": lambda: c.prepare(0, [(slot, *seq)]),
    }


REFUSED = "refused"


def _outcome(call: Callable[[], Any]) -> str:
    """What a call on a closed client did: `REFUSED` (ClientClosed, "the client is closed"),
    else what it raised or that it went through."""
    try:
        call()
    except ClientClosed as e:
        return REFUSED if str(e) == "the client is closed" else repr(e)
    except Exception as e:  # noqa: BLE001  (reported: the test fails on it)
        return repr(e)
    return "answered"


async def _aoutcome(call: Callable[[], Awaitable[Any]]) -> str:
    """`_outcome` for a coroutine's call."""
    try:
        await call()
    except ClientClosed as e:
        return REFUSED if str(e) == "the client is closed" else repr(e)
    except Exception as e:  # noqa: BLE001
        return repr(e)
    return "answered"


@pytest.mark.parametrize("cls", [KDAClient, AsyncKDAClient], ids=["sync", "async"])
def test_the_calls_tried_are_every_public_call(cls: type) -> None:
    """A method added later must be added to `_calls` (and refused when closed)."""
    public = {name for name in dir(cls) if not name.startswith("_")} - {"close", "aclose"}
    assert {name.partition("(")[0] for name in _calls(cls, "s", ())} == public


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_call_on_a_closed_client_is_refused_before_anything_is_sent(server, clean, framed, gen,
                                                                          transport) -> None:
    seq = make_sequence(3, gen)
    c = KDAClient(server.url, **_options(transport, framed))
    slot = c.alloc(1)[0]
    c.prefill(0, [(slot, *seq)])  # connections kept alive, a region registered (shm), the geometry known
    c.close()
    with _Unchanged(server, slot):
        outcomes = {name: _outcome(call) for name, call in _calls(c, slot, seq).items()}
        assert {name: got for name, got in outcomes.items() if got != REFUSED} == {}
    _free(server, slot)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_call_on_a_closed_async_client_is_refused_before_anything_is_sent(server, clean, framed, gen,
                                                                                transport) -> None:
    seq = make_sequence(3, gen)

    async def main() -> str:
        c = AsyncKDAClient(server.url, **_options(transport, framed))
        slot = (await c.alloc(1))[0]
        await c.prefill(0, [(slot, *seq)])
        await c.aclose()
        with _Unchanged(server, slot):
            outcomes = {name: await _aoutcome(call) for name, call in _calls(c, slot, seq).items()}
            assert {name: got for name, got in outcomes.items() if got != REFUSED} == {}
        return slot

    _free(server, asyncio.run(main()))


# -- shared memory prefills -------------------------------------------------------------------

@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
@pytest.mark.parametrize("transport", ["shm", "framed"])
def test_a_shared_memory_prefill_after_close_registers_no_region(server, clean, framed, gen, transport,
                                                                 used) -> None:
    """``used``: the client prefilled before close (the geometry known, the region dropped at
    close: the prefill would register a new one at once); else it knows nothing yet."""
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]
    c = KDAClient(server.url, **_options(transport, framed))
    if used:
        c.prefill(0, [(slot, *seq)])
        assert _mine(server)
    c.close()
    assert not _mine(server)
    with _Unchanged(server, slot):
        for target in (slot, None):
            with pytest.raises(ClientClosed, match=CLOSED):
                c.prefill(0, [(target, *seq)])
    _free(server, slot)


@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
@pytest.mark.parametrize("transport", ["shm", "framed"])
def test_an_async_shared_memory_prefill_after_close_registers_no_region(server, clean, framed, gen, transport,
                                                                       used) -> None:
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]

    async def main() -> None:
        c = AsyncKDAClient(server.url, **_options(transport, framed))
        if used:
            await c.prefill(0, [(slot, *seq)])
            assert _mine(server)
        await c.aclose()
        assert not _mine(server)
        with _Unchanged(server, slot):
            for target in (slot, None):
                with pytest.raises(ClientClosed, match=CLOSED):
                    await c.prefill(0, [(target, *seq)])

    asyncio.run(main())
    _free(server, slot)


# -- with blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("raised", [False, True], ids=["left", "raised"])
def test_leaving_a_with_block_closes_the_client(server, clean, framed, gen, raised) -> None:
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]
    with pytest.raises(RuntimeError) if raised else nullcontext():
        with KDAClient(server.url, **_options("framed", framed)) as c:
            c.prefill(0, [(slot, *seq)])
            if raised:
                raise RuntimeError("engine failed")
    with _Unchanged(server, slot):
        for call in (c.info, c.ready, lambda: c.slot_info(slot), lambda: c.prefill(0, [(slot, *seq)])):
            with pytest.raises(ClientClosed, match=CLOSED):
                call()
    _free(server, slot)


@pytest.mark.parametrize("raised", [False, True], ids=["left", "raised"])
def test_leaving_an_async_with_block_closes_the_client(server, clean, framed, gen, raised) -> None:
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]

    async def main() -> None:
        with pytest.raises(RuntimeError) if raised else nullcontext():
            async with AsyncKDAClient(server.url, **_options("framed", framed)) as c:
                await c.prefill(0, [(slot, *seq)])
                if raised:
                    raise RuntimeError("engine failed")
        with _Unchanged(server, slot):
            for call in (c.info, c.ready, lambda: c.slot_info(slot), lambda: c.prefill(0, [(slot, *seq)])):
                with pytest.raises(ClientClosed, match=CLOSED):
                    await call()

    asyncio.run(main())
    _free(server, slot)


# -- prepared prefills ------------------------------------------------------------------------

def test_a_prepared_prefill_of_a_closed_client_refuses_to_run(server, clean, framed, gen) -> None:
    """One still alive at close (released by it) and one released before: `run` raises the
    client's error, `release` and a ``with`` block's end do nothing."""
    seq = make_sequence(3, gen)
    c = KDAClient(server.url, **_options("framed", framed))
    a, b = c.alloc(2)
    alive = c.prepare(0, [(a, *seq)])
    alive.run(*seq)
    released = c.prepare(0, [(b, *seq)])
    released.release()
    c.close()
    with _Unchanged(server, a, b):
        for prepared in (alive, released):
            with pytest.raises(ClientClosed, match="^the client is closed"):
                prepared.run(*seq)
            prepared.release()
            with prepared:
                pass
    _free(server, a, b)


def test_an_async_prepared_prefill_of_a_closed_client_refuses_to_run(server, clean, framed, gen) -> None:
    seq = make_sequence(3, gen)

    async def main() -> list[str]:
        c = AsyncKDAClient(server.url, **_options("framed", framed))
        a, b = await c.alloc(2)
        alive = await c.prepare(0, [(a, *seq)])
        await alive.run(*seq)
        released = await c.prepare(0, [(b, *seq)])
        await released.release()
        await c.aclose()
        with _Unchanged(server, a, b):
            for prepared in (alive, released):
                with pytest.raises(ClientClosed, match="^the client is closed"):
                    await prepared.run(*seq)
                await prepared.release()
                async with prepared:
                    pass
        return [a, b]

    _free(server, *asyncio.run(main()))


# -- closing again ----------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closing_again_is_harmless_and_sends_nothing(server, clean, framed, gen, transport) -> None:
    """`close` twice, then the end of the ``with`` block closes a third time; a closed
    client cannot be entered again (its block could do nothing)."""
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]
    with KDAClient(server.url, **_options(transport, framed)) as c:
        c.prefill(0, [(slot, *seq)])
        alive = c.prepare(0, [(slot, *seq)]) if transport == "framed" else None
        if alive is not None:
            alive.run(*seq)  # still alive at close
        c.close()
        with _Unchanged(server, slot):
            c.close()
    with _Unchanged(server, slot):
        with pytest.raises(ClientClosed, match=CLOSED):
            with c:
                pytest.fail("entered a closed client")
    _free(server, slot)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closing_an_async_client_again_is_harmless_and_sends_nothing(server, clean, framed, gen,
                                                                     transport) -> None:
    seq = make_sequence(3, gen)
    slot = _alloc(server)[0]

    async def main() -> None:
        async with AsyncKDAClient(server.url, **_options(transport, framed)) as c:
            await c.prefill(0, [(slot, *seq)])
            alive = await c.prepare(0, [(slot, *seq)]) if transport == "framed" else None
            if alive is not None:
                await alive.run(*seq)
            await c.aclose()
            with _Unchanged(server, slot):
                await c.aclose()
        with _Unchanged(server, slot):
            with pytest.raises(ClientClosed, match=CLOSED):
                async with c:
                    pytest.fail("entered a closed client")

    asyncio.run(main())
    _free(server, slot)
