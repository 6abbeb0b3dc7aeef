"""kda-serve: KDA chunked prefill over HTTP.

Rooms by role (docs/ARCHITECTURE.md): `service.core` (`ServerCore`: pool, ordering,
batcher, kernels; no front end), `service.http` (the FastAPI app, `create_app`),
`service.kserve` (the Open Inference Protocol), `service.shm` (shared memory transports),
`service.ray_serve` (scale-out), `service.wire` (the wire formats, shared with the client),
`service.cli` (the ``kda-serve`` command). The client is the `kda_client` package.
"""
