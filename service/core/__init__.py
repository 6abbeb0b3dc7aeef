"""The server core: the pool, the per-slot ordering, the batcher and the kernels, with no
front end in it (`ServerCore`).

Modules, one job each: `server` (ServerCore), `batcher` (merging prefills into one launch),
`worker` (the device thread, and moving host work off the event loop), `validation`
(every check before anything changes), `inputs` (the transport-neutral prefill),
`gate_params` (per-layer gate parameters), `staging` (pinned host-to-GPU copies),
`metrics` (the core's Prometheus registry).

Importing this package loads none of its modules: `from service.core.server import
ServerCore` loads the kernels, `service.core.inputs` only torch.
"""
