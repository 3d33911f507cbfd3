"""A small sampling profiler for the scale benchmark's node processes (py-spy is not installed here).

Why sampling: a node process has 130 threads (one per simulated node, the shared etcd I/O thread, the
leader's loop); cProfile sees one thread. Every ``interval_s`` this reads every thread's stack
(``sys._current_frames``) and counts, per thread kind, the functions on it (inclusive) and the innermost
one (self). ``--profile DIR`` of benchmarks.scale writes one JSON file per process.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import threading
import time


def _kind(name: str) -> str:
    return re.sub(r"\d+", "", name)


class Sampler:
    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.samples = 0
        self.self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.incl_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="erm-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                kind = _kind(names.get(ident, "?"))
                seen = set()
                top = True
                while frame is not None:
                    code = frame.f_code
                    where = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
                    if top:
                        self.self_counts[kind][where] += 1
                        top = False
                    if where not in seen:
                        seen.add(where)
                        self.incl_counts[kind][where] += 1
                    frame = frame.f_back

    def stop(self, path: str, top: int = 40) -> None:
        self._stop.set()
        self._thread.join(5)
        out = {"samples": self.samples, "interval_s": self.interval_s, "time": time.time(), "threads": {}}
        for kind in self.incl_counts:
            out["threads"][kind] = {
                "self": self.self_counts[kind].most_common(top),
                "inclusive": self.incl_counts[kind].most_common(top),
            }
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
