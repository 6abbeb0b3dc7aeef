"""The framed socket front end (``--framed-socket PATH``): shared memory and CUDA IPC
prefills of co-located clients over a Unix socket, in length-prefixed frames
(`service.wire.frames`), outside HTTP and ASGI. The requests and replies are the documents
of ``POST /prefill`` with ``application/vnd.kda.shm+json``; only their envelope is leaner."""
from .server import FramedServer, Render, socket_path_problem

__all__ = ["FramedServer", "Render", "socket_path_problem"]
