"""`erm report`: a recorded run as a PNG and a self-contained HTML page.

Sources: the event log (etcd's compacted copy and/or ``--event-log`` files, merged without duplicates) and
the round records in etcd (``rounds/<n>/record``, kept for audits). Per-node utilisation over time comes
from the agents' "sample" events: etcd keeps only each node's latest ``metrics/<node>``.
"""

from __future__ import annotations

import base64
import html
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..etcd.client import EtcdClient
from ..wire.keyspace import Keyspace
from ..wire.records import RoundRecord
from .events import PERIODIC_KINDS, Event, EventError, merge, read_etcd, read_file
from .restores import round_restores, with_restores
from .status import MEASURED_HOW, decided_rounds, decision_rows, is_number, outcome_problem, outcomes_from_kvs


@dataclass
class RunData:
    run_id: str
    events: list[Event]
    decisions: list[dict[str, Any]]  # as in `erm status --json`: round, members, reason, gains, time
    errors: list[str] = field(default_factory=list)


def load_run(
    run_id: str, client: EtcdClient | None = None, prefix: str = "/elastic-rm", files: tuple[str, ...] = ()
) -> RunData:
    """Everything recorded about a run; malformed values and lines are listed in ``errors``, not fatal."""
    errors: list[str] = []
    streams: list[list[Event]] = []
    records: dict[int, RoundRecord] = {}
    outcomes: dict[int, dict[str, Any]] = {}
    if client is not None:
        keys = Keyspace(prefix, run_id)
        from_etcd, bad, _ = read_etcd(client, keys)
        streams.append(from_etcd)
        errors += bad
        kvs, _ = client.get_prefix(keys.rounds)
        records.update((r.round, r) for r in decided_rounds(kvs, errors))
        outcomes.update(outcomes_from_kvs(kvs, errors))
    for path in files:
        mine = []
        for item in read_file(path):
            if isinstance(item, EventError):
                errors.append(str(item))
            elif item.run == run_id:
                mine.append(item)
        streams.append(mine)
    events = merge(*streams)
    for e in events:  # rounds whose record is gone (another etcd, or a file only): the leader's event
        r = e.data.get("round")
        if e.kind == "decision" and isinstance(r, int) and r not in records:
            problem = _decision_problem(e.data)
            if problem is not None:
                errors.append(f"decision event at {e.time}: {problem}")
                continue
            records[r] = RoundRecord(
                round=r,
                members=tuple(e.data.get("members") or ()),
                reason=str(e.data.get("reason") or ""),
                predicted_gain=e.data.get("predicted_gain"),
                confidence=e.data.get("confidence"),
                time=e.time,
            )
    for e in events:  # the leader's outcome event carries the same record (files, or a compacted etcd)
        r = e.data.get("round")
        if e.kind == "outcome" and isinstance(r, int) and r not in outcomes:
            problem = outcome_problem(e.data)
            if problem is None:
                outcomes[r] = dict(e.data)
            else:
                errors.append(f"outcome event at {e.time}: {problem}")
    decisions = with_restores(
        decision_rows([records[n] for n in sorted(records)], outcomes), round_restores(events)
    )
    return RunData(run_id, events, decisions, errors)


def _decision_problem(data: dict[str, Any]) -> str | None:
    """Why a decision event's data cannot stand for its round record (None: it can)."""
    members = data.get("members")
    if members is not None and not (isinstance(members, list) and all(isinstance(m, str) for m in members)):
        return f"field 'members' must be a list of node ids, got {members!r:.40}"
    for name in ("predicted_gain", "confidence"):
        x = data.get(name)
        if x is not None and not is_number(x):
            return f"field {name!r} must be a number or null, got {x!r:.40}"
    return None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _restore_cell(d: dict[str, Any]) -> str:
    if d.get("restored_step") is None:
        return "-"
    down = "-" if d.get("downtime_s") is None else f"{d['downtime_s']:.2f} s"
    again = "-" if d.get("redone_steps") is None else str(d["redone_steps"])
    return f"step {d['restored_step']}, {down}, {again}"


ERROR_BINS = (-1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0)  # predicted - measured gain


def error_histogram(decisions: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Counts of decisions by prediction error (predicted - measured gain), in bins of ERROR_BINS; the
    first and last bins are open. Decisions without a measured outcome are not counted."""
    errs = [d["prediction_error"] for d in decisions if d.get("prediction_error") is not None]
    edges = ERROR_BINS
    labels = [f"< {edges[0]:+.0%}"] + [
        f"{a:+.0%} .. {b:+.0%}" for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    labels.append(f">= {edges[-1]:+.0%}")
    counts = [0] * len(labels)
    for e in errs:
        counts[sum(e >= x for x in edges)] += 1
    return list(zip(labels, counts, strict=True))


def write_report(run: RunData, out_dir: str, all_events: bool = False) -> tuple[str, str, list[str]]:
    """Write ``<run>.png`` and ``<run>.html`` (the PNG embedded) into ``out_dir``; returns both paths and
    the decision labels drawn on the picture. The events table leaves out the periodic kinds (samples,
    checkpoints) unless ``all_events``."""
    from .timeline import plot_run

    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, f"{run.run_id}.png")
    labels = plot_run(run, png)
    with open(png, "rb") as f:
        image = base64.b64encode(f.read()).decode()
    esc = html.escape
    rows = []
    for d in run.decisions:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["time"])) if d.get("time") else "-"
        measured = _pct(d.get("measured_gain"))
        if d.get("measured_gain") is not None:
            measured += (
                f" ({d['throughput_before']:,.0f} &rarr; {d['throughput_after']:,.0f} samples/s,"
                f" vs round {d['compared_to_round']})"
            )
        rows.append(
            f"<tr><td>{d['round']}</td><td>{esc(when)}</td><td>{len(d['members'])}</td>"
            f"<td>{esc(', '.join(d['members']))}</td><td>{esc(d['reason'] or '-')}</td>"
            f"<td>{_pct(d.get('predicted_gain'))}</td><td>{measured}</td>"
            f"<td>{_pct(d.get('prediction_error'))}</td><td>{_restore_cell(d)}</td></tr>"
        )
    hist = error_histogram(run.decisions)
    hist_rows = "".join(
        f"<tr><td>{esc(label)}</td><td>{n}</td><td>{'&#9608;' * n}</td></tr>" for label, n in hist
    )
    event_rows = [
        f"<tr><td>{esc(time.strftime('%H:%M:%S', time.localtime(e.time)))}</td><td>{esc(e.node)}</td>"
        f"<td>{esc(e.kind)}</td><td>{esc(e.message)}</td></tr>"
        for e in run.events
        if all_events or e.kind not in PERIODIC_KINDS
    ]
    errors = "".join(f"<li>{esc(m)}</li>" for m in run.errors)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>elastic-rm run {esc(run.run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:75em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}} img{{max-width:100%}}
.note{{color:#666;font-size:90%}}</style></head><body>
<h1>elastic-rm run {esc(run.run_id)}</h1>
<p>{len(run.events)} events, {len(run.decisions)} decisions, {sum(e.kind == "sample" for e in run.events)}
samples from {len({e.node for e in run.events if e.kind == "sample"})} node(s).</p>
<img alt="timeline of run {esc(run.run_id)}" src="data:image/png;base64,{image}">
<h2>Decisions</h2>
<table><tr><th>round</th><th>time</th><th>world</th><th>members</th><th>reason</th><th>predicted gain</th>
<th>measured gain</th><th>prediction error</th><th>restore: step, downtime, steps trained again</th></tr>
{"".join(rows)}</table>
<p class="note">{esc(MEASURED_HOW)}.</p>
<h2>Prediction error (predicted - measured gain)</h2>
<table><tr><th>error</th><th>decisions</th><th></th></tr>{hist_rows}</table>
<h2>Events</h2>
<table><tr><th>time</th><th>node</th><th>kind</th><th>message</th></tr>
{"".join(event_rows)}</table>
{f"<h2>Malformed records (skipped)</h2><ul>{errors}</ul>" if errors else ""}
</body></html>
"""
    path = os.path.join(out_dir, f"{run.run_id}.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return png, path, labels
