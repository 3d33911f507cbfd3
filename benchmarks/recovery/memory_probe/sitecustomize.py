"""A memory probe for ``benchmarks.recovery.memory --probe DIR`` (diagnostics; never on by default).

On ``PYTHONPATH`` with ``ERM_MEMDIAG_DIR`` set, every Python process of the run (agents, spares, workers)
starts a thread that, each time ``$ERM_MEMDIAG_DIR/trigger`` changes (the benchmark writes the round
index after each sample), writes ``<pid>-<round>.json`` there: ``/proc`` RSS (anonymous, file, per
mapping), glibc's heap (``mallinfo2``, and ``malloc_info`` per arena), ``sys.modules``, the threads, the
objects the garbage collector tracks (by type), the live tensors' bytes, and the Python heap allocated
since the first trigger and still alive (``tracemalloc``, started then so that tracing costs little).
JSON only; ``python -m benchmarks.recovery.memory_breakdown DIR`` reads the files.
"""

import os
import sys
import threading

DIR = os.environ.get("ERM_MEMDIAG_DIR")


def _mallinfo():
    import ctypes

    class MI2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MI2
    m = libc.mallinfo2()
    out = {n: getattr(m, n) for n, _ in MI2._fields_}
    # per-arena via malloc_info
    path = f"{DIR or '/tmp/memdiag'}/mi-{os.getpid()}.xml"
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    fp = libc.fopen(path.encode(), b"w")
    if not fp:
        return out
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    import re

    text = open(path).read()
    os.unlink(path)
    heaps = re.findall(r'<heap nr="(\d+)">(.*?)</heap>', text, re.S)
    arenas = []
    for nr, body in heaps:
        sysm = re.search(r'<system type="current" size="(\d+)"/>', body)
        tot = re.search(r'<total type="rest" count="(\d+)" size="(\d+)"/>', body)
        fast = re.search(r'<total type="fast" count="(\d+)" size="(\d+)"/>', body)
        arenas.append(
            {
                "nr": int(nr),
                "system": int(sysm.group(1)) if sysm else None,
                "free_rest": int(tot.group(2)) if tot else None,
                "free_fast": int(fast.group(2)) if fast else None,
            }
        )
    out["arenas"] = arenas
    tail = text.rsplit("</heap>", 1)[-1]
    out["mmap_total"] = re.findall(r'<total type="mmap" count="(\d+)" size="(\d+)"/>', tail)
    out["system_total"] = re.findall(r'<system type="current" size="(\d+)"/>', tail)
    return out


def _proc():
    d = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads", "VmSize"):
                d[k] = v.strip()
    with open("/proc/self/smaps_rollup") as fh:
        d["rollup"] = fh.read()
    # largest anon mappings
    maps = []
    cur = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                cur = {"range": parts[0], "name": parts[5] if len(parts) > 5 else "", "rss": 0}
                maps.append(cur)
            elif parts[0] == "Rss:" and cur is not None:
                cur["rss"] = int(parts[1])
    byname = {}
    for m in maps:
        key = m["name"] or "[anon]"
        if key.startswith("/") and "/site-packages/" in key:
            key = "lib:" + key.split("/site-packages/")[-1].split("/")[0]
        byname[key] = byname.get(key, 0) + m["rss"]
    d["rss_by_mapping_kib"] = dict(sorted(byname.items(), key=lambda kv: -kv[1])[:40])
    anon = sorted((m for m in maps if not m["name"]), key=lambda m: -m["rss"])[:30]
    d["largest_anon"] = [(m["range"], m["rss"]) for m in anon]
    d["n_maps"] = len(maps)
    return d


def _py():
    import gc
    import tracemalloc

    d = {
        "modules": sorted(sys.modules),
        "threads": [t.name for t in threading.enumerate()],
        "gc_counts": gc.get_count(),
        "freeze_count": gc.get_freeze_count(),
    }
    counts = {}
    objs = gc.get_objects()
    for o in objs:
        t = type(o)
        key = f"{t.__module__}.{t.__qualname__}"
        counts[key] = counts.get(key, 0) + 1
    d["n_objects"] = len(objs)
    d["types"] = counts
    torch = sys.modules.get("torch")
    if torch is not None:
        seen = {}
        n = 0
        for o in objs:
            try:
                if isinstance(o, torch.Tensor) and not o.is_meta:
                    n += 1
                    s = o.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
            except Exception:
                pass
        d["tensors"] = n
        d["tensor_bytes"] = sum(seen.values())
    del objs
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        d["traced"] = tracemalloc.get_traced_memory()
        stats = snap.statistics("lineno")
        d["tm_lineno"] = {str(s.traceback[0]): [s.size, s.count] for s in stats if s.size >= 2048}
        stats = snap.statistics("traceback")
        d["tm_tb"] = [[s.size, s.count, [str(f) for f in s.traceback]] for s in stats[:200]]
    return d


def _dump(tag):
    import json

    role = " ".join(sys.argv)[:300]
    out = {"pid": os.getpid(), "ppid": os.getppid(), "argv": role, "tag": tag}
    for name, fn in (("proc", _proc), ("malloc", _mallinfo), ("py", _py)):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": repr(exc)}
    tmp = f"{DIR}/{os.getpid()}-{tag}.json.tmp"
    with open(tmp, "w") as fh:
        json.dump(out, fh)
    os.rename(tmp, f"{DIR}/{os.getpid()}-{tag}.json")


def _loop():
    import time

    last = None
    trig = f"{DIR}/trigger"
    try:
        last = open(trig).read().strip()
    except OSError:
        pass
    while True:
        time.sleep(0.3)
        try:
            tag = open(trig).read().strip()
        except OSError:
            continue
        if tag and tag != last:
            last = tag
            import tracemalloc

            if not tracemalloc.is_tracing():
                tracemalloc.start(4)  # only what is allocated from now on is traced (and stays)
            try:
                _dump(tag)
            except Exception as exc:  # noqa: BLE001
                print("memdiag failed", repr(exc), file=sys.stderr)


if DIR and "benchmarks.recovery.memory" not in " ".join(sys.argv) and "etcd" not in sys.argv[0]:
    threading.Thread(target=_loop, name="memdiag", daemon=True).start()
