"""The demo's picture names its events without overlapping labels: a number at each event's line (stacked
when events come close together) and the events listed under the panels."""

from __future__ import annotations

import matplotlib.pyplot as plt

from elastic_rm.obs.timeline import demo_figure, plot_demo


def test_events_seconds_apart_get_labels_that_do_not_overlap(tmp_path):
    rows = [
        {"t": 100.0 + i, "step": i, "rank": 0, "world": 2 if i < 30 else 3, "samples": 8} for i in range(60)
    ]
    events = [
        {"t": 129.0, "kind": "node", "text": "node c joins"},
        {"t": 129.5, "kind": "round", "text": "round 3: scaling to 3 nodes"},
        {"t": 130.0, "kind": "fault", "text": "node b SIGKILLed"},
        {"t": 145.0, "kind": "stop", "text": "erm stop"},
    ]
    fig = demo_figure(rows, events)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        numbers = [t for ax in fig.axes for t in ax.texts if t.get_text() in {"1", "2", "3", "4"}]
        assert sorted(t.get_text() for t in numbers) == ["1", "2", "3", "4"]
        boxes = [t.get_window_extent(renderer) for t in numbers]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (a, b)
        listed = "\n".join(t.get_text() for t in fig.texts)
        for number, e in enumerate(events, start=1):
            assert f"{number}  " in listed and e["text"] in listed, listed
    finally:
        plt.close(fig)
    path = plot_demo(rows, events, str(tmp_path / "timeline.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
