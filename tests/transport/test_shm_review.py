"""A review of shared memory region registration on the folder's live server: a region name
must be one every per-name route can address. A "/" in a name cannot be (an encoded slash
names no route: ``service.http.encoded_slash``), so such a name is refused when it is
registered, through ``POST /shm/regions`` as through the KServe extension, with nothing
registered."""
from __future__ import annotations

import httpx
from transport_helpers import Region, Server


def test_a_region_name_with_a_slash_is_refused_at_registration(server: Server) -> None:
    """``POST /shm/regions`` with the name "a/b" (which ``DELETE /shm/regions/a%2Fb`` and
    ``GET /v2/systemsharedmemory/region/a%2Fb/status`` could never reach): 400 naming the
    field, and the region list unchanged."""
    region = Region(4096)
    name = f"{region.name}/b"
    try:
        before = httpx.get(f"{server.url}/shm/regions").json()
        # a lease: were it registered, it goes by itself (no per-name route could unregister it)
        r = httpx.post(f"{server.url}/shm/regions", json=region.registration(ttl_s=0.1, name=name))
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/problem+json"), r.text
        assert "'/'" in r.json()["detail"] and name in r.json()["detail"], r.text
        assert httpx.get(f"{server.url}/shm/regions").json() == before
    finally:
        region.unlink()
