"""``--metrics-port``: the Prometheus page on a port of its own, without the API key (as
Triton serves ``/metrics`` on 8002), for a scraper that holds no credentials. Nothing but
the metrics is served there; the API port keeps requiring the key for ``/metrics`` too.

The page is prometheus_client's WSGI server on a daemon thread over the core's registry
(every path answers the page; ``?name[]=kda_used_slots`` selects families). The registry's
collectors read the pool through its lock, so a scrape from that thread is safe.
"""
from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_wsgi_server


class MetricsServer:
    """The metrics page served on ``host:port`` until `close` (bound on construction: a
    busy port raises OSError before the API serves)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_wsgi_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
