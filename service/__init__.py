"""kda-serve: KDA chunked prefill over HTTP.

`service.core.ServerCore` (pool, ordering, batcher, kernels; no HTTP), `service.app.create_app`
(the FastAPI front end), `service.cli` (the ``kda-serve`` command) and `service.client`
(`KDAClient`, `AsyncKDAClient`).
"""
