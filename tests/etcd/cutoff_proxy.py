"""A TCP proxy on loopback in front of one etcd member, for one client: `cut()` drops every connection
through it and refuses new ones (that client's host partitioned from etcd while others keep writing),
`heal()` lets connections through again. ``answer_delay_s``: each 64 KiB of the server's answers waits that
long (0.01: about 6 MB/s, so a large read stays in flight while small messages pass at once), and
``down_bytes`` counts them. Threads only; every loop ends when its socket closes."""

from __future__ import annotations

import socket
import threading
import time


class CutoffProxy:
    def __init__(self, target: str, answer_delay_s: float = 0.0) -> None:
        host, port = target.rsplit(":", 1)
        self._answer_delay_s = answer_delay_s
        self.down_bytes = 0
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="cutoff-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                down.close()
                continue
            try:
                up = socket.create_connection(self._target, timeout=2)
            except OSError:
                down.close()
                continue
            for s in (down, up):
                s.settimeout(None)
            with self._lock:
                self._conns |= {down, up}
            for a, b, answers in ((down, up, False), (up, down, True)):
                threading.Thread(target=self._pump, args=(a, b, answers), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if answers:
                    self.down_bytes += len(data)
                    if self._answer_delay_s:
                        time.sleep(self._answer_delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._conns.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            conns = list(self._conns)
        self._drop(*conns)

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> CutoffProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
