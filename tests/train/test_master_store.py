"""wait_for_master_store: a rank other than 0 waits until rank 0's store listens, bounded."""

from __future__ import annotations

import socket
import threading

from elastic_rm.train.master_store import wait_for_master_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(monkeypatch, rank: str, port: int) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def test_a_rank_waits_until_the_store_listens_then_connects(monkeypatch):
    port = _free_port()
    _env(monkeypatch, "2", port)
    listening, accepted = threading.Event(), []
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def serve_later() -> None:
        threading.Event().wait(0.3)  # rank 0 is still building its model
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.set()
        conn, _ = server.accept()
        accepted.append(conn)

    t = threading.Thread(target=serve_later, daemon=True)
    t.start()
    try:
        assert wait_for_master_store(limit_s=10) is True
        assert listening.is_set()  # it returned only once the store listened
        t.join(5)
        assert len(accepted) == 1
    finally:
        for c in accepted:
            c.close()
        server.close()


def test_nothing_to_wait_for_on_rank_0_or_with_the_agent_store(monkeypatch):
    with socket.socket() as server:  # a store that listens: a probe would connect and say True
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        _env(monkeypatch, "0", port)
        assert wait_for_master_store() is False
        _env(monkeypatch, "1", port)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        assert wait_for_master_store() is False
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
        assert wait_for_master_store() is True  # the same rank without the agent's store probes
        monkeypatch.delenv("MASTER_ADDR")
        assert wait_for_master_store() is False


def test_the_wait_is_bounded_when_no_store_comes(monkeypatch):
    _env(monkeypatch, "1", _free_port())
    assert wait_for_master_store(limit_s=0.2) is False
