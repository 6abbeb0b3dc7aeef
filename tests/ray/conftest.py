"""Fixtures for the Ray Serve tests: a local Ray cluster on 127.0.0.1 running the sharded
application with two CPU shards, torn down at the end. The whole folder is skipped when
Ray is not installed (``pip install 'kda-serve[ray]'``)."""
from __future__ import annotations

import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray_helpers import HV, K, LAYERS, V  # noqa: E402

from service.client import KDAClient  # noqa: E402
from service.config import Settings  # noqa: E402
from service.ray_serve.config import ScaleOut  # noqa: E402
from service.ray_serve.deploy import DIRECTORY_NAMESPACE, build_app, directory_actor_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHARD_SLOTS = 16
MAX_BODY_MB = 1
APP = "kda-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """The running application: its URL, settings and the two shard names."""

    url: str
    settings: Settings
    scale_out: ScaleOut

    @property
    def shards(self) -> list[str]:
        return self.scale_out.shard_names

    def kill(self, deployment: str) -> None:
        """Kill every replica of ``deployment`` the hard way (no graceful stop); Serve
        starts new ones."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and f"#{deployment}#" in a["name"]]
        assert names, f"no replica of {deployment!r}"
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the ingress answers and every shard is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/shards", timeout=10)
                if r.status_code == 200 and all(row["up"] for row in r.json()["shards"]):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the application did not become ready")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A local Ray cluster (loopback only, no dashboard) serving two CPU shards of
    SHARD_SLOTS slots each behind two ingress replicas (so consecutive requests may meet
    different replicas, and their caches of the slot directory); Serve's HTTP proxy on a
    free 127.0.0.1 port."""
    state_dir = tmp_path_factory.mktemp("ray-state")
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, device="cpu", num_layers=LAYERS, num_slots=SHARD_SLOTS,
                        num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=5.0, max_body_mb=MAX_BODY_MB,
                        log_level="warning")
    scale_out = ScaleOut(shards=2, gpus_per_shard=0, cpus_per_shard=1, ingress_replicas=2, cpus_per_ingress=0.5,
                         state_dir=str(state_dir),
                         app_name=APP, health_check_period_s=0.5, move_wait_s=5.0)
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings, scale_out), name=APP, route_prefix="/")
        c = Cluster(f"http://127.0.0.1:{port}", settings, scale_out)
        c.wait_ready()
        yield c
    finally:
        serve.shutdown()
        try:
            ray.kill(ray.get_actor(directory_actor_name(APP), namespace=DIRECTORY_NAMESPACE))
        except ValueError:
            pass  # never created
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The float64 reference runs many tiny ops: one thread beats a pool fighting the
    cluster's processes for 2 cores. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[KDAClient]:
    with KDAClient(cluster.url, timeout=60) as c:
        yield c


@pytest.fixture
def json_client(cluster: Cluster) -> Iterator[KDAClient]:
    with KDAClient(cluster.url, encoding="json", timeout=60) as c:
        yield c


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
