"""`FramedExchange` reads a reply whatever pieces the socket delivers it in: its first
receive takes what is there (one receive for a small reply), the rest follows. The peer
here is a plain Unix socket that answers one request with the bytes of a reply frame
(`service.wire.frames.reply_frame`) in the pieces a test chooses."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kda_client.framed import FramedExchange
from service.wire.frames import Op, reply_frame


def _answer_in_pieces(path: Path, reply: bytes, cuts: list[int]) -> threading.Thread:
    """A peer on ``path`` that reads one request and writes ``reply`` cut at ``cuts``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            conn.recv(1 << 16)
            for a, b in zip([0, *cuts], [*cuts, len(reply)]):
                conn.sendall(reply[a:b])
                time.sleep(0.02)  # the client's receive returns with this piece alone
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("body_bytes, cuts", [
    (10, []),  # one piece: one receive
    (10, [2]),  # the length itself split
    (10, [4, 6, 9]),  # the status, the timing's length, the timing split
    (300_000, [70_000]),  # larger than the first receive asks for
    (300_000, [3, 150_000]),
], ids=["whole", "length split", "head split", "large", "large, length split"])
def test_a_reply_in_any_pieces_reads_whole(tmp_path: Path, body_bytes: int, cuts: list[int]) -> None:
    body = bytes(range(256)) * (body_bytes // 256) + bytes(body_bytes % 256)
    reply = reply_frame(200, "refill;dur=0.001, total;dur=0.002", body)
    peer = _answer_in_pieces(tmp_path / "s", reply, cuts)
    exchange = FramedExchange(str(tmp_path / "s"), None, 10)
    try:
        answer = exchange.request(Op.PING, b"")
    finally:
        exchange.close()
    peer.join(10)
    assert answer.status == 200 and bytes(answer.body) == body
    assert answer.headers["server-timing"] == "refill;dur=0.001, total;dur=0.002"
