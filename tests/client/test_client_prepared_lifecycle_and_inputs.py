"""`kda_client` as an engine adopting it uses it, against one live kda-serve
(with a framed socket) and, for the error mapping, a stub HTTP peer:

- shared memory regions the client makes are never left behind: not in /dev/shm, not in the
  server's registry (a refused or failed registration, a ``with`` block left by an
  exception, prepared prefills still alive at close or garbage-collected unreleased);
- a prepared prefill runs only on the connection it was prepared on (ids count from 1 on
  every connection: a stale one must not run another connection's prefill);
- bad inputs raise ValueError before anything is created or sent, the same on every
  encoding and transport, sync and async;
- server refusals map to the documented `KDAError` subclasses with their problem fields,
  network failures to httpx's exceptions; the prefix cache calls are typed as documented;
- one sync client shared by threads gives each its own, right result.
"""
from __future__ import annotations

import asyncio
import gc
import http.server
import json
import os
import threading
import zlib
from typing import Any, Iterator

import httpx
import pytest
import torch

from kda_client import (
    AsyncKDAClient, BadRequest, KDAClient, PoolFullError, PrefixAlloc, ServerError, ServiceUnavailable,
    SlotNotFound, Unauthorized,
)
from kda_client.shm import Geometry
from server_harness import (  # noqa: F401  (one_torch_thread: autouse for this module)
    GEOMETRY_ARGS, H, HV, K, SLOTS, V, Server, free_port, make_sequence, one_torch_thread, start_server,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def framed(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("client-sock") / "kda.sock")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, framed: str) -> Iterator[Server]:
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", framed, "--max-shm-regions", "12"],
                       tmp_path_factory.mktemp("client") / "kda.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kda-{os.getpid()}-")}


def _regions(server: Server) -> set[str]:
    return {r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()}


@pytest.fixture
def clean(server: Server) -> Iterator[None]:
    """The test starts with no region of this process registered or in /dev/shm, and must
    leave none (whatever it leaves is cleared for the next test)."""
    mine = f"kda-{os.getpid()}-"
    assert not {r for r in _regions(server) if r.startswith(mine)} and not _shm_files()
    yield
    left = {r for r in _regions(server) if r.startswith(mine)}
    for name in left:
        httpx.delete(f"{server.url}/shm/regions/{name}")
    assert not _shm_files()


def _mine(server: Server) -> set[str]:
    return {r for r in _regions(server) if r.startswith(f"kda-{os.getpid()}-")}


# -- input checks: ValueError before anything is created or sent ------------------------

CLIENTS = [dict(), dict(encoding="json"), dict(transport="shm")]
CLIENT_IDS = ["safetensors", "json", "shm"]


@pytest.mark.parametrize("kw", CLIENTS, ids=CLIENT_IDS)
def test_a_dtype_without_a_wire_form_is_a_value_error_before_anything_is_made(server, clean, gen, kw) -> None:
    """float64 has no wire form: every path says so with ValueError up front (before: a 400
    from the server on safetensors, TypeError on JSON, KeyError on shm after the region was
    created and registered)."""
    seq = [t.double() for t in make_sequence(4, gen)]
    with KDAClient(server.url, **kw) as c:
        free = c.info()["free_slots"]
        with pytest.raises(ValueError, match="float64"):
            c.prefill(0, [(None, *seq)])
        assert not _mine(server) and not _shm_files()
        assert c.info()["free_slots"] == free


@pytest.mark.parametrize("kw", CLIENTS, ids=CLIENT_IDS)
def test_sequences_that_cannot_be_packed_are_a_value_error_on_every_path(server, clean, gen, kw) -> None:
    """Two sequences whose q differ in head dim, or v in dtype, cannot be packed along tokens:
    the safetensors path said ValueError, JSON a RuntimeError (or packed mixed dtypes
    silently), shm a 400 after writing past q's place (or converted silently)."""
    a, b = make_sequence(4, gen), list(make_sequence(4, gen))
    wide, mixed = list(b), list(b)
    wide[0] = torch.randn(4, H, K + 1, generator=gen)
    mixed[2] = mixed[2].bfloat16()
    with KDAClient(server.url, **kw) as c:
        for bad in (wide, mixed):
            with pytest.raises(ValueError, match="trailing shape"):
                c.prefill(0, [(None, *a), (None, *bad)])
        assert not _mine(server)


@pytest.mark.parametrize("kw", CLIENTS, ids=CLIENT_IDS)
def test_an_input_that_is_not_a_tensor_is_a_value_error(server, clean, gen, kw) -> None:
    q, k, v, g, beta = make_sequence(4, gen)
    with KDAClient(server.url, **kw) as c, pytest.raises(ValueError, match="torch.Tensor"):
        c.prefill(0, [(None, q.numpy(), k, v, g, beta)])


def test_the_async_client_checks_inputs_alike(server, clean, gen) -> None:
    seq = [t.double() for t in make_sequence(4, gen)]

    async def main() -> None:
        for kw in CLIENTS:
            async with AsyncKDAClient(server.url, **kw) as c:
                with pytest.raises(ValueError, match="float64"):
                    await c.prefill(0, [(None, *seq)])
    asyncio.run(main())
    assert not _mine(server)


def test_a_shape_error_in_one_sequence_stays_the_servers_400_with_its_field(server, clean, gen) -> None:
    """What the server validates (one sequence's head dim) keeps its problem document."""
    seq = list(make_sequence(4, gen))
    seq[0] = torch.randn(4, H, K + 1, generator=gen)
    for kw in CLIENTS:
        with KDAClient(server.url, **kw) as c, pytest.raises(BadRequest) as e:
            c.prefill(0, [(None, *seq)])
        assert e.value.status == 400 and e.value.problem["field"] == "q", e.value.problem


# -- shared memory regions: nothing left behind -------------------------------------------

def test_a_registration_the_server_refuses_leaves_no_file(server, clean, gen) -> None:
    seq = make_sequence(3, gen)
    others = []
    try:
        while True:  # fill the registry (--max-shm-regions 12), whatever else holds some
            o = KDAClient(server.url, transport="shm")
            others.append(o)
            try:
                o.prefill(0, [(None, *seq)])
            except BadRequest as e:
                assert e.problem["type"].endswith(":shared-memory-limit"), e.problem
                break
        assert not _shm_files()
        with KDAClient(server.url, transport="shm") as c, pytest.raises(BadRequest) as refused:
            c.prefill(0, [(None, *seq)])
        assert refused.value.problem["type"].endswith(":shared-memory-limit"), refused.value.problem
        assert not _shm_files()
    finally:
        for o in others:
            o.close()
    assert not _mine(server)


def test_a_registration_that_cannot_connect_leaves_no_file(gen) -> None:
    c = KDAClient(f"http://127.0.0.1:{free_port()}", transport="shm")
    c._arena.geometry = Geometry(HV, V, K, torch.float32)  # as learnt from /info before the server went away
    with c, pytest.raises(httpx.ConnectError):
        c.prefill(0, [(None, *make_sequence(3, gen))])
    assert not _shm_files()


def test_a_with_block_left_by_an_exception_unregisters_the_region(server, clean, gen) -> None:
    with pytest.raises(RuntimeError, match="engine"):
        with KDAClient(server.url, transport="shm") as c:
            c.prefill(0, [(None, *make_sequence(3, gen))])
            assert _mine(server)
            raise RuntimeError("engine failed")
    assert not _mine(server)


def test_a_region_the_server_forgot_is_registered_again(server, clean, gen) -> None:
    seq = make_sequence(5, gen)
    with KDAClient(server.url) as ref:
        want = ref.prefill(0, [(None, *seq)])
        ref.free(want.slots[0])
    with KDAClient(server.url, transport="shm") as c:
        first = c.prefill(0, [(None, *seq)])
        for name in _mine(server):  # as a lease running out would
            httpx.delete(f"{server.url}/shm/regions/{name}")
        again = c.prefill(0, [(None, *seq)])
        assert torch.equal(again.o_packed, want.o_packed) and torch.equal(first.o_packed, want.o_packed)
        c.free(first.slots[0])
        c.free(again.slots[0])
    assert not _mine(server)


# -- prepared prefills ----------------------------------------------------------------

def _tokens(c: KDAClient, slot: str) -> list[int]:
    return c.slot_info(slot)["tokens_per_layer"]


def test_close_releases_the_prepared_prefills_still_alive(server, clean, framed, gen) -> None:
    seq = make_sequence(3, gen)
    c = KDAClient(server.url, transport="shm", framed_socket=framed)
    slot = c.alloc(1)[0]
    prepared = c.prepare(0, [(slot, *seq)])
    prepared.run(*seq)
    c.close()
    assert not _mine(server), "close left the prepared prefill's region registered"
    prepared.release()  # already released by close: nothing to do, nothing raised
    with pytest.raises(ValueError, match="released"):
        prepared.run(*seq)
    with KDAClient(server.url) as other:
        other.free(slot)


def test_a_with_block_left_by_an_exception_releases_its_prepared_prefills(server, clean, framed, gen) -> None:
    seq = make_sequence(3, gen)
    with pytest.raises(RuntimeError, match="engine"):
        with KDAClient(server.url, transport="shm", framed_socket=framed) as c:
            slot = c.alloc(1)[0]
            c.prepare(0, [(slot, *seq)]).run(*seq)
            raise RuntimeError("engine failed")
    assert not _mine(server)
    with KDAClient(server.url) as other:
        other.free(slot)


def test_a_garbage_collected_prepared_prefill_is_released(server, clean, framed, gen) -> None:
    """One dropped unreleased gives its region back at the client's next prepare (and close):
    an engine that forgets `release` does not fill the server's registry for the lease."""
    seq = make_sequence(3, gen)
    with KDAClient(server.url, transport="shm", framed_socket=framed) as c:
        slot = c.alloc(1)[0]
        for _ in range(15):  # more than the server's 12 regions: each must have gone before the next
            c.prepare(0, [(slot, *seq)]).run(*seq)
            gc.collect()
        kept = c.prepare(0, [(slot, *seq)])
        assert len(_mine(server)) == 1
        del kept
        gc.collect()
    assert not _mine(server)
    with KDAClient(server.url) as other:
        other.free(slot)


def test_a_stale_prepared_prefill_never_runs_another_connections_prefill(server, clean, framed, gen) -> None:
    """Ids count from 1 on every framed connection. ``old`` was prepared on the first; the
    connection then dropped (here by hand; any failed request on it does the same), and
    ``new`` was prepared on the next, under the same id. ``old.run`` must raise SlotNotFound
    and leave ``new``'s slot alone, not run ``new`` and hand back o never written."""
    seq_a, seq_b = make_sequence(3, gen), make_sequence(3, gen)
    with KDAClient(server.url, transport="shm", framed_socket=framed) as c:
        a, b = c.alloc(2)
        old = c.prepare(0, [(a, *seq_a)])
        c._framed.close()  # the connection drops
        new = c.prepare(0, [(b, *seq_b)])
        before = (_tokens(c, a), _tokens(c, b))
        with pytest.raises(SlotNotFound):
            old.run(*seq_a)
        assert (_tokens(c, a), _tokens(c, b)) == before
        new.run(*seq_b)
        assert _tokens(c, b)[0] == before[1][0] + 3
        with pytest.raises(SlotNotFound):  # nothing left to release on the server: said, and not sent
            old.release()
        new.release()
        c.free(a)
        c.free(b)
    assert not _mine(server)


def test_the_async_client_releases_and_binds_prepared_prefills_alike(server, clean, framed, gen) -> None:
    seq_a, seq_b = make_sequence(3, gen), make_sequence(3, gen)

    async def main() -> None:
        c = AsyncKDAClient(server.url, transport="shm", framed_socket=framed)
        a, b = await c.alloc(2)
        old = await c.prepare(0, [(a, *seq_a)])
        await c._framed.aclose_connection()
        new = await c.prepare(0, [(b, *seq_b)])
        tokens_b = (await c.slot_info(b))["tokens_per_layer"]
        with pytest.raises(SlotNotFound):
            await old.run(*seq_a)
        assert (await c.slot_info(b))["tokens_per_layer"] == tokens_b
        await new.run(*seq_b)
        del old
        gc.collect()
        await c.aclose()  # releases new, and old's region
        assert not _mine(server)
        await new.release()  # nothing left to do
        async with AsyncKDAClient(server.url) as other:
            await other.free(a)
            await other.free(b)
    asyncio.run(main())


# -- errors ---------------------------------------------------------------------------

def test_server_refusals_carry_their_problem(server, clean, gen) -> None:
    with KDAClient(server.url) as c:
        with pytest.raises(SlotNotFound) as e:
            c.prefix_info("no/such key")
        assert e.value.status == 404 and e.value.problem["type"].endswith(":unknown-prefix")
        assert e.value.problem["field"] == "key" and "no/such key" in e.value.problem["detail"]
        with pytest.raises(SlotNotFound) as e:
            c.free("never-issued")
        assert e.value.problem["type"].endswith(":unknown-slot")
        with pytest.raises(BadRequest) as bad:
            c.alloc(SLOTS + 1)
        assert bad.value.status == 400 and "count" in bad.value.problem["detail"]
        held = c.alloc(c.info()["free_slots"])
        try:
            with pytest.raises(PoolFullError) as full:
                c.alloc(1)
            assert full.value.status == 503 and isinstance(full.value, ServiceUnavailable)
            assert full.value.retry_after is not None and full.value.retry_after > 0
        finally:
            for slot in held:
                c.free(slot)


class _Stub(http.server.BaseHTTPRequestHandler):
    """Canned answers by path: what a proxy or a broken server may send."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str], length: int | None = None) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        problem = {"content-type": "application/problem+json"}
        if self.path == "/info":
            self._send(401, json.dumps({"type": "urn:x:unauthorized", "status": 401, "detail": "key"}).encode(),
                       problem)
        elif self.path.startswith("/slots/busy"):
            self._send(503, json.dumps({"type": "urn:x:overloaded", "status": 503}).encode(),
                       {**problem, "retry-after": "2.5"})
        elif self.path.startswith("/slots/proxy"):
            self._send(502, b"<html>bad gateway</html>", {"content-type": "text/html"})
        elif self.path.startswith("/slots/cut"):
            self._send(200, b'{"created": 1', {"content-type": "application/json"}, length=200)
            self.close_connection = True
        else:
            self._send(404, b"", {})


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    port = free_port()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Stub)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    srv.shutdown()
    srv.server_close()


def test_refusals_and_broken_answers_map_to_the_documented_errors(stub: str) -> None:
    async def both() -> list[BaseException]:
        async with AsyncKDAClient(stub) as a:
            out = []
            for call in (a.info(), a.slot_info("busy"), a.slot_info("proxy"), a.slot_info("cut")):
                try:
                    await call
                except BaseException as e:  # noqa: BLE001
                    out.append(e)
            return out

    with KDAClient(stub) as c:
        sync = []
        for call in (c.info, lambda: c.slot_info("busy"), lambda: c.slot_info("proxy"), lambda: c.slot_info("cut")):
            with pytest.raises(Exception) as e:
                call()
            sync.append(e.value)
    for errors in (sync, asyncio.run(both())):
        unauthorized, busy, proxy, cut = errors
        assert isinstance(unauthorized, Unauthorized) and unauthorized.problem["detail"] == "key"
        assert type(busy) is ServiceUnavailable and busy.retry_after == 2.5
        assert isinstance(proxy, ServerError) and proxy.status == 502 and "bad gateway" in proxy.problem["detail"]
        assert isinstance(cut, httpx.RemoteProtocolError), repr(cut)


def test_no_server_is_httpx_connect_error() -> None:
    with KDAClient(f"http://127.0.0.1:{free_port()}") as c:
        with pytest.raises(httpx.ConnectError):
            c.info()
        assert c.ready() is False


# -- the prefix cache -----------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(transport="shm")], ids=["http", "shm"])
def test_prefix_cache_calls_are_typed_as_documented(server, clean, gen, kw) -> None:
    key = "tenant/a b?#%2F.ü"  # a key needing every kind of quoting in a path
    with KDAClient(server.url, **kw) as c:
        slot = c.alloc(1)[0]
        for layer in range(2):
            c.prefill(layer, [(slot, *make_sequence(70, gen))], checkpoints=[[(64, f"{key}.64")]])
        entry = c.publish(slot, key)
        assert entry["key"] == key and entry["tokens"] == 70 and entry["complete"]
        assert c.prefix_info(key) == {**entry, "last_used": c.prefix_info(key)["last_used"]}
        assert c.prefix_info(f"{key}.64")["tokens"] == 64
        got = c.alloc(2, prefix=[f"{key}.64", key, "missing"])
        assert isinstance(got, PrefixAlloc) and len(got.slots) == 2
        assert (got.matched, got.key, got.tokens) == (2, key, 70)
        none = c.alloc(1, prefix=["missing"])
        assert (none.matched, none.key, none.tokens) == (0, None, 0)
        assert c.drop_prefix(key) is True and c.drop_prefix(key) is False
        with pytest.raises(SlotNotFound):
            c.prefix_info(key)
        assert c.drop_prefix(f"{key}.64") is True
        for s in [slot, *got.slots, *none.slots]:
            c.free(s)


# -- threads --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(transport="shm")], ids=["http", "shm"])
def test_one_sync_client_shared_by_threads_gives_each_its_result(server, clean, gen, kw) -> None:
    seqs = [make_sequence(3 + i, gen) for i in range(12)]
    with KDAClient(server.url) as ref:
        want = [ref.prefill(0, [(None, *s)]) for s in seqs]
        for out in want:
            ref.free(out.slots[0])
    got: list[Any] = [None] * len(seqs)
    with KDAClient(server.url, **kw) as c:
        def work(i: int) -> None:
            got[i] = c.prefill(0, [(None, *seqs[i])])
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for out, ref_out in zip(got, want):
            assert torch.equal(out.o_packed, ref_out.o_packed) and torch.equal(out.final_state, ref_out.final_state)
            c.free(out.slots[0])
    assert not _mine(server)


def test_a_with_block_error_is_not_hidden_by_a_failed_release(server, clean, framed, gen) -> None:
    """The block raises after the framed connection dropped: its release then fails (the
    prepared prefill went with the connection: `SlotNotFound`), and the block's own error
    is what the caller sees; the region is unregistered all the same."""
    seq = make_sequence(3, gen)
    with KDAClient(server.url, transport="shm", framed_socket=framed) as c:
        slot = c.alloc(1)[0]
        with pytest.raises(KeyError, match="the block's own error"):
            with c.prepare(0, [(slot, *seq)]) as step:
                step.run(*seq)
                c._framed.close()  # the connection drops
                raise KeyError("the block's own error")
        assert not _mine(server)
        c.free(slot)
