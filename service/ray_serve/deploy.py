"""The Ray Serve application: one shard deployment per GPU and an HTTP ingress.

- shard ``{prefix}-{i}``: `ShardServer` as a deployment of exactly one replica (its pool
  is the state), reserving ``gpus_per_shard`` GPUs (1 in production: Ray sets
  CUDA_VISIBLE_DEVICES, so the shard's ``cuda`` is its own GPU);
- ``ingress``: the FastAPI app of `create_ingress_app` over a `ShardedCore` holding a
  handle to every shard, ``ingress_replicas`` replicas;
- the slot directory: a detached named actor (``{app_name}-slot-directory`` in namespace
  ``kda-serve``) created by the first ingress replica and found by the others, so moved
  slots stay found across ingress restarts; restarted by Ray if it dies, reading its
  file under ``state_dir`` back.

    serve.run(build_app(settings, scale_out), name=scale_out.app_name, route_prefix="/")
"""
from __future__ import annotations

from typing import Optional

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from service.config import Settings

from .config import ScaleOut
from .directory import SlotDirectory
from .ingress import create_ingress_app
from .links import DirectoryLink, ShardLink
from .router import ShardedCore
from .shard import ShardServer

DIRECTORY_NAMESPACE = "kda-serve"
MAX_ONGOING_REQUESTS = 1024
"""Requests a replica takes at once: a shard's batcher merges concurrent prefills, so Serve
must not queue them in front of it (its default is 5)."""
GRACEFUL_SHUTDOWN_S = 120.0
"""How long Serve lets a stopping shard drain and write its last snapshot."""


def directory_actor_name(app_name: str) -> str:
    return f"{app_name}-slot-directory"


class ShardDeployment(ShardServer):
    """`ShardServer` as Serve runs it: constructed and started in the replica's loop,
    closed (last snapshot) when the replica stops gracefully."""

    async def __init__(self, name: str, settings: Settings, state_dir: Optional[str]) -> None:  # type: ignore[misc]
        ShardServer.__init__(self, name, settings, state_dir)
        await self.start()

    async def __del__(self) -> None:
        await self.close()


@serve.ingress()
class IngressDeployment:
    """The HTTP ingress: a `ShardedCore` over ``shards`` (name -> handle)."""

    def __init__(self, settings: Settings, shards: dict[str, DeploymentHandle], app_name: str,
                 directory_path: Optional[str], move_wait_s: float) -> None:
        actor = ray.remote(SlotDirectory).options(
            name=directory_actor_name(app_name), namespace=DIRECTORY_NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_restarts=-1, max_task_retries=-1,
        ).remote(directory_path)
        links = {name: ShardLink(name, handle) for name, handle in shards.items()}
        self._settings = settings
        self._core = ShardedCore(settings, links, DirectoryLink(actor), move_wait_s=move_wait_s)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_ingress_app(self._core, self._settings)


def build_app(settings: Settings, scale_out: ScaleOut) -> Application:
    """The Serve application of ``scale_out.shards`` shards and the ingress."""
    shard = serve.deployment(ShardDeployment).options(
        num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_gpus": scale_out.gpus_per_shard, "num_cpus": scale_out.cpus_per_shard},
        health_check_period_s=scale_out.health_check_period_s, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
    )
    shards = {name: shard.options(name=name).bind(name, settings, scale_out.state_dir)
              for name in scale_out.shard_names}
    ingress = serve.deployment(IngressDeployment).options(
        name="ingress", num_replicas=scale_out.ingress_replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": scale_out.cpus_per_ingress},
        health_check_period_s=scale_out.health_check_period_s,
    )
    return ingress.bind(settings, shards, scale_out.app_name, scale_out.directory_path, scale_out.move_wait_s)


def app_builder(args: dict[str, str]) -> Application:
    """For ``serve run`` / a KubeRay RayService ``import_path``: ``args`` are the flags of
    ``kda-serve-ray`` without dashes (``{"shards": "8", "num_slots": "256"}``)."""
    from .config import parse_scale_out

    argv = [f"--{key.replace('_', '-')}={value}" for key, value in args.items()]
    settings, scale_out = parse_scale_out(argv)
    return build_app(settings, scale_out)
