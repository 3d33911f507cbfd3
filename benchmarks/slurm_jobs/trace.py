"""The arrival trace of the live multi-job benchmark: 12 jobs over 10 minutes on 8 nodes.

Three kinds of user, four jobs each, arriving in turn:

- over-asking: asks for 5 or 6 nodes, but the job stops scaling past 2 or 3 (its curve is flat there);
- well-sized: asks for 3 or 4 nodes, about where its curve bends;
- under-asking: asks for 1 or 2 nodes of a job that scales almost linearly to 8.

A job's work is set so that it takes ``minutes_at_request`` at its requested size (sleep-based steps,
``STEP_S`` on one node). The requested node-time is 1.2x what 8 nodes give over the arrival window, so
static jobs queue (some wait minutes) and an elastic one has idle nodes to grow into only at times.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_S = 1.0  # one node's step time (seconds); the curve divides it
GLOBAL_BATCH = 1024
NODES = 8

CURVES = {
    "over": "1:1,2:1.8,3:2.2,4:2.3,8:2.4",
    "well": "1:1,2:1.9,4:3.4,8:4.2",
    "under": "1:1,2:1.95,4:3.8,8:7.2",
}


@dataclass(frozen=True)
class TraceJob:
    name: str
    submit_s: float  # arrival, from the trace's start
    nodes: int  # what the user asks for (static runs it at this size)
    kind: str  # over, well or under (its curve)
    minutes_at_request: float

    @property
    def curve(self) -> str:
        return CURVES[self.kind]

    def speedup(self, world: int) -> float:
        points = [(int(w), float(s)) for w, s in (p.split(":") for p in self.curve.split(","))]
        if world <= points[0][0]:
            return points[0][1] * world / points[0][0]
        for (w0, s0), (w1, s1) in zip(points, points[1:], strict=False):
            if world <= w1:
                return s0 + (s1 - s0) * (world - w0) / (w1 - w0)
        return points[-1][1]

    @property
    def samples(self) -> int:
        """The samples that take ``minutes_at_request`` at the requested size."""
        steps = self.minutes_at_request * 60 * self.speedup(self.nodes) / STEP_S
        return int(steps) * GLOBAL_BATCH


TRACE = (
    TraceJob("j01", 0, 6, "over", 2.5),
    TraceJob("j02", 30, 2, "under", 2.5),
    TraceJob("j03", 80, 4, "well", 2.5),
    TraceJob("j04", 130, 1, "under", 3.0),
    TraceJob("j05", 180, 5, "over", 2.5),
    TraceJob("j06", 240, 3, "well", 2.0),
    TraceJob("j07", 290, 2, "under", 2.5),
    TraceJob("j08", 350, 6, "over", 2.0),
    TraceJob("j09", 400, 4, "well", 2.0),
    TraceJob("j10", 450, 2, "under", 2.5),
    TraceJob("j11", 520, 5, "over", 2.0),
    TraceJob("j12", 600, 3, "well", 2.0),
)


def requested_load(trace=TRACE, nodes: int = NODES) -> float:
    """Requested node-time over what the cluster gives during the arrival window."""
    window = max(j.submit_s for j in trace) - min(j.submit_s for j in trace)
    return sum(j.nodes * j.minutes_at_request * 60 for j in trace) / (nodes * window)
