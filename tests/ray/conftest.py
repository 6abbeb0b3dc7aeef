"""Fixtures for the Ray Serve tests: a local Ray cluster on 127.0.0.1 running the sharded
application with two CPU shards, torn down at the end. The whole folder is skipped when
Ray is not installed (``pip install -e '.[ray]'`` from the checkout): each test module starts with
``pytest.importorskip("ray.serve")``, and nothing here imports Ray before a fixture runs."""
from __future__ import annotations

import zlib
from typing import Iterator

import pytest
import torch

from ray_helpers import (APP, HV, K, LAYERS, MAX_BODY_MB, ROOT, SHARD_SLOTS, V, Cluster, free_port,
                         start_local_ray)

from kda_client.client import KDAClient
from service.config import Settings
from service.ray_serve.config import ScaleOut
from server_harness import one_torch_thread  # noqa: F401  (autouse fixture for this folder)



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A local Ray cluster (loopback only, no dashboard) serving two CPU shards of
    SHARD_SLOTS slots each behind two ingress replicas (so consecutive requests may meet
    different replicas, and their caches of the slot directory); Serve's HTTP proxy on a
    free 127.0.0.1 port. Module-scoped: torn down before the next module, so no idle
    cluster competes with the rest of the suite for the CPU."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from service.ray_serve.deploy import DIRECTORY_NAMESPACE, build_app, directory_actor_name

    state_dir = tmp_path_factory.mktemp("ray-state")
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, device="cpu", num_layers=LAYERS, num_slots=SHARD_SLOTS,
                        num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=5.0, max_body_mb=MAX_BODY_MB,
                        log_level="warning")
    scale_out = ScaleOut(shards=2, gpus_per_shard=0, cpus_per_shard=1, ingress_replicas=2, cpus_per_ingress=0.5,
                         state_dir=str(state_dir),
                         app_name=APP, health_check_period_s=0.5, move_wait_s=5.0)
    start_local_ray(ray, num_cpus=4, env_vars={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
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
