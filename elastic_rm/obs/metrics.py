"""Prometheus metrics of one agent (node): resources, GPUs, step times, round and state.

Each agent owns an :class:`AgentMetrics` with a private registry (no process-global state, so several
agents in one test process do not collide). The agent feeds it the same record it publishes to etcd
(:func:`elastic_rm.wire.metrics.build_record`), so the two views never disagree.

Names follow Prometheus conventions: ``elastic_rm_`` prefix, base units in the name (``_bytes``,
``_seconds``, ``_ratio`` for 0..1, ``_celsius``), ``_total`` for counters. Every series carries a ``node``
label. The full list is in docs/agent.md and in :data:`METRIC_NAMES`.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from torch.distributed.elastic.agent.server.api import WorkerState

__all__ = ["AgentMetrics", "CONTENT_TYPE_LATEST", "METRIC_NAMES"]

# The agent's own state, one gauge series each: joining (before its first round), draining (workers
# asked to stop at a step boundary), else its worker group's state as torch names it (healthy, failed...).
AGENT_STATES = ("joining", "draining", *(s.value.lower() for s in WorkerState))


class AgentMetrics:
    """Gauges of one node; update with :meth:`update`, :meth:`set_round`, :meth:`set_state`."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()  # a scrape never sees an update half done
        self.registry = CollectorRegistry(auto_describe=True)
        r, n = self.registry, ["node"]

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*n, *labels], registry=r)

        self.cpu = gauge(
            "elastic_rm_node_cpu_usage_ratio",
            "Busy fraction of all the node's cores over the agent's window (stat=mean|max|last)",
            ("stat",),
        )
        self.mem_used = gauge("elastic_rm_node_memory_used_bytes", "Memory in use on the node")
        self.mem_available = gauge(
            "elastic_rm_node_memory_available_bytes", "Memory available for new allocations"
        )
        self.mem_total = gauge("elastic_rm_node_memory_total_bytes", "Physical memory of the node")
        self.worker_rss = gauge(
            "elastic_rm_worker_resident_memory_bytes", "Resident memory of a worker", ("pid",)
        )
        self.worker_cpu = gauge(
            "elastic_rm_worker_cpu_usage_cores",
            "CPU time of a worker per wall second (1 = one core)",
            ("pid",),
        )
        self.gpu_util = gauge("elastic_rm_gpu_utilization_ratio", "GPU busy fraction, window mean", ("gpu",))
        self.gpu_mem_used = gauge("elastic_rm_gpu_memory_used_bytes", "GPU memory in use", ("gpu",))
        self.gpu_mem_total = gauge("elastic_rm_gpu_memory_total_bytes", "GPU memory size", ("gpu",))
        self.gpu_temp = gauge("elastic_rm_gpu_temperature_celsius", "GPU temperature", ("gpu",))
        self.gpu_throttled = gauge(
            "elastic_rm_gpu_throttled",
            "1 when a slowdown reason (power, thermal) was active in the window",
            ("gpu",),
        )
        self.gpu_reason = gauge(
            "elastic_rm_gpu_throttle_reason",
            "1 for each NVML clock-event reason seen in the window",
            ("gpu", "reason"),
        )
        self.step_time = gauge(
            "elastic_rm_step_duration_seconds", "Step time over the window, workers pooled", ("quantile",)
        )
        self.step_rate = gauge(
            "elastic_rm_step_throughput_samples_per_second",
            "Samples per second, summed over the node's workers",
        )
        self.spares = gauge("elastic_rm_spare_workers", "Warm spare worker processes waiting for a round")
        self.spares_rss = gauge(
            "elastic_rm_spare_resident_memory_bytes", "Resident memory of the waiting spare workers, summed"
        )
        self.step_window = gauge("elastic_rm_step_window_steps", "Steps reported within the window")
        self.step_age = gauge("elastic_rm_step_report_age_seconds", "Seconds since the newest step report")
        self.steps_total = Counter(
            "elastic_rm_steps_reported", "Steps reported by the node's workers", n, registry=r
        )
        self.round = gauge("elastic_rm_round", "Rendezvous round number this node runs in")
        self.state = gauge("elastic_rm_agent_state", "1 for the agent's current state", ("state",))
        self.last_update = gauge(
            "elastic_rm_metrics_timestamp_seconds", "Unix time of the newest resource sample"
        )
        self._steps_seen = 0
        self.current_state = ""
        self.set_state("joining")

    def update(self, record: dict[str, Any]) -> None:
        """Set every resource and step gauge from a metrics record (the etcd ``metrics/<node>`` dict)."""
        with self._lock:
            self._update(record)

    def _update(self, record: dict[str, Any]) -> None:
        node = self.node
        for stat in ("mean", "max", "last"):
            self.cpu.labels(node, stat).set(record["cpu"][f"util_{stat}"])
        self.mem_used.labels(node).set(record["mem"]["used_bytes"])
        self.mem_available.labels(node).set(record["mem"]["available_bytes"])
        self.mem_total.labels(node).set(record["mem"]["total_bytes"])
        self.last_update.labels(node).set(record["t"])
        for g in (self.worker_rss, self.worker_cpu):
            g.clear()  # workers come and go: drop the series of those that left
        for w in record["workers"]:
            self.worker_rss.labels(node, str(w["pid"])).set(w["rss_bytes"])
            self.worker_cpu.labels(node, str(w["pid"])).set(w["cpu_util"])
        for g in (
            self.gpu_util,
            self.gpu_mem_used,
            self.gpu_mem_total,
            self.gpu_temp,
            self.gpu_throttled,
            self.gpu_reason,
        ):
            g.clear()
        for gpu in record["gpus"]:
            i = str(gpu["index"])
            if gpu["util"] is not None:
                self.gpu_util.labels(node, i).set(gpu["util"])
            if gpu["temp_c"] is not None:
                self.gpu_temp.labels(node, i).set(gpu["temp_c"])
            self.gpu_mem_used.labels(node, i).set(gpu["mem_used_bytes"])
            self.gpu_mem_total.labels(node, i).set(gpu["mem_total_bytes"])
            self.gpu_throttled.labels(node, i).set(1 if gpu["throttled"] else 0)
            for reason in gpu["throttle_reasons"]:
                self.gpu_reason.labels(node, i, reason).set(1)
        for g in (self.spares, self.spares_rss):
            g.clear()
        if record.get("spares") is not None:
            self.spares.labels(node).set(record["spares"]["count"])
            self.spares_rss.labels(node).set(record["spares"]["rss_bytes"])
        steps = record.get("steps")
        for g in (self.step_time, self.step_rate, self.step_window, self.step_age):
            g.clear()  # aged out: absent, not a stale value
        if steps is not None:
            self.step_time.labels(node, "0.5").set(steps["p50_s"])
            self.step_time.labels(node, "0.9").set(steps["p90_s"])
            self.step_rate.labels(node).set(steps["samples_per_s"])
            self.step_window.labels(node).set(steps["steps"])
            self.step_age.labels(node).set(steps["age_s"])

    def add_steps(self, total: int) -> None:
        """Advance the steps counter to the channel's running total (``AgentChannel.steps_total``)."""
        with self._lock:
            if total > self._steps_seen:
                self.steps_total.labels(self.node).inc(total - self._steps_seen)
                self._steps_seen = total

    def set_round(self, number: int) -> None:
        with self._lock:
            self.round.labels(self.node).set(number)

    def set_state(self, state: str) -> None:
        """One series per known state, 1 for the current one (the Prometheus "enum" pattern)."""
        with self._lock:
            self.state.clear()
            for s in sorted({*AGENT_STATES, state}):
                self.state.labels(self.node, s).set(1 if s == state else 0)
            self.current_state = state

    def exposition(self) -> bytes:
        """The text exposition format of this registry."""
        with self._lock:
            return generate_latest(self.registry)


METRIC_NAMES = (
    "elastic_rm_node_cpu_usage_ratio",
    "elastic_rm_node_memory_used_bytes",
    "elastic_rm_node_memory_available_bytes",
    "elastic_rm_node_memory_total_bytes",
    "elastic_rm_worker_resident_memory_bytes",
    "elastic_rm_worker_cpu_usage_cores",
    "elastic_rm_gpu_utilization_ratio",
    "elastic_rm_gpu_memory_used_bytes",
    "elastic_rm_gpu_memory_total_bytes",
    "elastic_rm_gpu_temperature_celsius",
    "elastic_rm_gpu_throttled",
    "elastic_rm_gpu_throttle_reason",
    "elastic_rm_step_duration_seconds",
    "elastic_rm_step_throughput_samples_per_second",
    "elastic_rm_step_window_steps",
    "elastic_rm_step_report_age_seconds",
    "elastic_rm_steps_reported_total",
    "elastic_rm_round",
    "elastic_rm_agent_state",
    "elastic_rm_metrics_timestamp_seconds",
)
