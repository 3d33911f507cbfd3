"""What the scale benchmark reads off etcd itself: its Prometheus metrics (writes, database size) and its
process's CPU time."""

from __future__ import annotations

import re
import urllib.request

import psutil

WANTED = {
    "etcd_mvcc_put_total": "puts",
    "etcd_mvcc_delete_total": "deletes",
    "etcd_mvcc_txn_total": "txns",
    "etcd_mvcc_db_total_size_in_bytes": "db_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes": "db_in_use_bytes",
    "etcd_debugging_mvcc_current_revision": "revision",
    "etcd_debugging_mvcc_watcher_total": "watchers",
    "etcd_server_proposals_committed_total": "proposals",
}
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def scrape(endpoint: str) -> dict[str, float]:
    """The counters above from ``http://<endpoint>/metrics`` (etcd serves them on its client port)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(1) in WANTED:
            out[WANTED[m.group(1)]] = out.get(WANTED[m.group(1)], 0.0) + float(m.group(2))
    return out


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)
