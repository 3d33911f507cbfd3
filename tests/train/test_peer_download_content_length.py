"""PeerClient.download reads a peer's answer only with a valid Content-Length: one that is not a number
ended in a ValueError (int() of the header), which no restore source catches, instead of the PeerError
naming the peer that makes a restore go on to the next source."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError


@pytest.mark.parametrize("header", [b"Content-Length: 5x\r\n", b"Content-Length: -5\r\n", b""])
def test_an_answer_without_a_valid_content_length_is_a_peer_error(tmp_path: Path, header: bytes) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + header + b"Connection: close\r\n\r\nhello")

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        peer = PeerEndpoint("n1", f"http://127.0.0.1:{srv.getsockname()[1]}", "token")
        client = PeerClient(peer, timeout_s=10, tls=None)
        with pytest.raises(
            PeerError, match=r"n1: GET /steps/3/files/a: an answer without a valid Content-Length"
        ):
            client.download(3, "a", tmp_path / "a")
        t.join(10)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.part").exists()
