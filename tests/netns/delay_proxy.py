"""A TCP proxy that delays every byte by a fixed time each way, in order: added latency on one path (the
hosts' path to etcd) where the kernel has no sch_netem. Runs an asyncio loop in a thread of the test."""

from __future__ import annotations

import asyncio
import threading
import time


class DelayProxy:
    """Listens on (host, port 0) and forwards to `target` ("host:port"), each chunk `delay_s` late."""

    def __init__(self, host: str, target: str, delay_s: float) -> None:
        self.host, self.delay_s = host, delay_s
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="delay-proxy")
        self._server: asyncio.AbstractServer | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, 0), self._loop
        ).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            queue.put_nowait(None)
            await sender

    def __exit__(self, *exc: object) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
