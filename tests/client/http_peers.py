"""A tiny HTTP peer's life for the client tests that need a server other than kda-serve
(one that answers as a misbehaving proxy would): served on a thread, shut down after."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from typing import Iterator, TypeVar

JOIN_TIMEOUT = 10.0
"""How long the shutdown waits for the serving thread (s)."""
_Server = TypeVar("_Server", bound=ThreadingHTTPServer)


@contextmanager
def serving(server: _Server) -> Iterator[_Server]:
    """``server`` serving on a daemon thread inside the block, shut down and closed after."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(JOIN_TIMEOUT)
