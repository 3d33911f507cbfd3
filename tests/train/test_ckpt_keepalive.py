"""Replica pushes on one kept HTTP connection: a checkpoint at every step sends the files (the first one
begins the push) and the commit of each step on the same connection (counted by a loopback relay between
client and server); a connection the server closed while idle, or after refusing a push, is opened again
by the next push."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from elastic_rm.checkpoint.manifest import step_dirname
from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError
from elastic_rm.checkpoint.server import CheckpointServer
from tests.train.test_ckpt_transport import make_step


class Relay:
    """Accepts connections on a loopback port and pipes each to `target`; counts the connections and
    sets `closed` when one has ended (either side closed it)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            server = socket.create_connection(self.target)
            done = threading.Event()
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b, done), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if not done.is_set():
                done.set()
                self.closed.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def relayed(tmp_path: Path):
    with CheckpointServer(tmp_path / "n1", timeout_s=2.0) as server:
        relay = Relay(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        try:
            yield (
                server,
                relay,
                PeerClient(PeerEndpoint("n1", f"http://127.0.0.1:{relay.port}", server.token)),
            )
        finally:
            relay.close()


def test_pushes_share_one_connection_and_reopen_it_when_the_server_closed_it(relayed, tmp_path: Path) -> None:
    server, relay, client = relayed
    src = tmp_path / "src"
    files = {"__0_0.distcp": b"x" * 5000, ".metadata": b"meta"}
    for step in (1, 2, 3):
        client.push_replica(
            "n0", step, src / step_dirname(step), sorted(files), make_step(src, step, files), 2
        )
    assert relay.accepted == 1  # three steps, two files and a commit each, one connection
    assert server.store.listing()["replicas"] == {"n0": [2, 3]}

    assert relay.closed.wait(60)  # the server closed the idle connection (its 2 s timeout)
    client.push_replica("n0", 4, src / step_dirname(4), sorted(files), make_step(src, 4, files), 2)
    assert relay.accepted == 2 and server.store.listing()["replicas"] == {"n0": [3, 4]}

    # a refused push (a file that does not match its manifest) closes the connection; the next opens one
    body = make_step(src, 5, files)
    (src / step_dirname(5) / "__0_0.distcp").write_bytes(b"y" * 5000)
    with pytest.raises(PeerError, match="HTTP 422"):
        client.push_replica("n0", 5, src / step_dirname(5), sorted(files), body, 2)
    client.push_replica("n0", 6, src / step_dirname(6), sorted(files), make_step(src, 6, files), 2)
    assert relay.accepted == 3 and server.store.listing()["replicas"] == {"n0": [4, 6]}
    client.close()
