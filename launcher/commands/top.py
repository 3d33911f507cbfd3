"""`erm top`: `erm status`, live. One read of the run's keys, then an etcd watch keeps a local copy current;
the screen is redrawn when something changed (at most 5 times a second), never by polling etcd."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from ..interrupt import wait_interruptibly
from .status import UsageError, add_connection_arguments, connect, no_run, render, resolve_run

HELP = "Live view of a job (erm status, refreshed from etcd watches); Ctrl-C to quit."
MIN_FRAME_S = 0.2  # coalesce bursts of changes into one redraw


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument(
        "--decisions", type=int, default=5, help="how many of the last decisions to show (default 5)"
    )


class WatchedRun:
    """The run's keys, read once and then kept current by a prefix watch. After a compaction (a long
    outage) the watch hands over the whole prefix as re-read by etcd, which replaces the copy."""

    def __init__(self, client, keys) -> None:
        self._client, self._keys = client, keys
        self._lock = threading.Lock()
        self.changed = threading.Event()
        self._kvs: dict = {}
        self.revision = 0
        self.error = ""
        self._cancel = None
        self._load()

    def _load(self) -> None:
        kvs, revision = self._client.get_prefix(self._keys.run)
        with self._lock:
            self._kvs = {kv.key: kv for kv in kvs}
            self.revision = revision
        self._cancel = self._client.watch_prefix(
            self._keys.run, revision + 1, self._apply, self._failed, on_resync=self._resync
        )
        self.changed.set()

    def _resync(self, kvs, revision: int) -> None:
        with self._lock:
            self._kvs = {kv.key: kv for kv in kvs}
            self.revision = revision
        self.changed.set()

    def _apply(self, changes) -> None:
        with self._lock:
            for c in changes:
                if c.kind == "put":
                    self._kvs[c.kv.key] = c.kv
                else:
                    self._kvs.pop(c.kv.key, None)
                self.revision = max(self.revision, c.kv.mod_revision)
        self.changed.set()

    def _failed(self, exc) -> None:
        with self._lock:
            self.error = f"watch failed ({exc}); re-reading"
        self.changed.set()

    def snapshot(self) -> tuple[list, int, str]:
        with self._lock:
            return sorted(self._kvs.values(), key=lambda kv: kv.key), self.revision, self.error

    def reload_if_failed(self) -> None:
        if self.error:
            self.close()
            self.error = ""
            self._load()

    def close(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.obs.status import status_from_kvs
    from elastic_rm.wire.keyspace import Keyspace

    console = Console()
    try:
        with connect(args) as client:
            keys = Keyspace(args.prefix, resolve_run(client, args.prefix, args.run_id))
            watched = WatchedRun(client, keys)
            if not watched.snapshot()[0]:  # a run id that is not there
                watched.close()
                raise no_run(client, keys)

            def frame():
                kvs, revision, error = watched.snapshot()
                status = status_from_kvs(keys, kvs, revision, decisions=max(0, args.decisions))
                if error:
                    status["errors"].append(error)
                stamp = time.strftime("%H:%M:%S")
                return render(status, title=f"{stamp} rev {revision}  ")

            try:
                with Live(frame(), console=console, auto_refresh=False, vertical_overflow="crop") as live:
                    # SIGTERM ends it as Ctrl-C does: piped, the last frame is printed as Live stops
                    signal.signal(signal.SIGTERM, _interrupt)
                    while True:
                        wait_interruptibly(watched.changed)
                        watched.changed.clear()
                        watched.reload_if_failed()
                        live.update(frame(), refresh=True)
                        time.sleep(MIN_FRAME_S)
            except KeyboardInterrupt:
                return 0
            finally:
                watched.close()
    except (EtcdError, ValueError, UsageError) as exc:
        print(f"erm top: error: {exc}", file=sys.stderr)
        return 2
