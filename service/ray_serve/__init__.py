"""kda-serve on Ray Serve: one shard (a `service.core.server.ServerCore`: pool, batcher, kernels)
per GPU, behind an ingress that serves the single server's HTTP API.

- `shard.ShardServer`: a shard; slot ids ``{shard}.{incarnation}.{token}`` name it;
- `router.ShardedCore`: routing by slot, split/reassembled prefills, placement, moves;
- `ingress.create_ingress_app`: the FastAPI app over a `ShardedCore`;
- `directory.SlotDirectory`: where moved slots live (a detached named actor);
- `deploy.build_app`: the Serve application; `cli`: the ``kda-serve-ray`` command.

Ray is imported only by `deploy`, `links`, `router`, `ingress` (through `router`) and
`cli`; the base install of kda-serve never needs it. See docs/SCALE_OUT.md.
"""
