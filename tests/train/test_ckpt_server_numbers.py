"""The checkpoint server's numbers on the wire (Content-Length, ?keep=) are ASCII digits: str.isdigit()
also took '²' (a header is read as Latin-1, a query is percent-decoded), which int() then refused, and
a Content-Length of thousands of digits passed it too, past int()'s limit of 4300: each was a 500 with
a traceback in the agent's log instead of the refusal that says what is wrong."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from elastic_rm.checkpoint.server import CheckpointServer


def request(server: CheckpointServer, method: str, path: str, body: bytes, length: str) -> tuple[int, dict]:
    """One request with this Content-Length, as sent (Latin-1); the status and the JSON answer."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: peer\r\nAuthorization: Bearer {server.token}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while chunk := s.recv(65536):  # a refusal closes the connection
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


@pytest.fixture
def server(tmp_path: Path):
    with CheckpointServer(tmp_path / "n0") as s:
        yield s


@pytest.mark.parametrize(
    ("length", "status"),
    [("\u00b2", 411), ("1\u00b2", 411), ("-1", 411), ("9" * 5000, 413), ("0" * 40 + "3", 200)],
)
def test_a_content_length_that_is_not_ascii_digits_is_refused(server, length: str, status: int) -> None:
    code, answer = request(server, "PUT", "/v1/replicas/n1/4/files/a?begin=1", b"abc", length)
    assert code == status, answer
    if status != 200:
        assert "internal error" not in answer["error"]


@pytest.mark.parametrize("keep", ["%C2%B2", "%D9%A1%D9%A1", "1" * 5000, "0"])
def test_a_keep_that_is_not_a_small_ascii_integer_is_refused(server, keep: str) -> None:
    code, answer = request(server, "POST", f"/v1/replicas/n1/4/commit?keep={keep}", b"{}", "2")
    assert code == 400 and "an integer from 1 to 1000" in answer["error"], answer
