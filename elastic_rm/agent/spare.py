"""A warm spare worker process: Python started and the heavy modules imported before its round exists.

The agent starts it as ``python -u spare.py FD NICE MODULE,... SCRIPT ARGS...`` (the script and its
arguments only label the process for ``ps`` and ``pgrep -f``; it imports nothing of elastic-rm). The
imports (then a collection that freezes what they made: ``gc.freeze()``) run on a thread at nice NICE
(19 next to training workers, so that a warming spare takes only idle CPU; Linux nice values are per
thread); the main thread keeps its priority for the script. When
the imports are done it writes one byte, ``R``, on its socket. Then it waits for its round: one JSON
message (no pickle) with the script's argv, the full environment and the working directory, and with
the file descriptors of its stdout and stderr when torch redirects them (``--redirects``/``--tee``). It
takes them over and runs the script with ``runpy`` as ``python -u script.py`` would (``__main__``,
``sys.argv``, ``sys.path[0]``): a fresh interpreter per round, torchrun's semantics, minus the imports.
End-of-file on the socket means the agent is gone or done with it: it exits 0.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import socket
import sys
import threading

READY = b"R"
MAX_MESSAGE = 1 << 22  # the environment of a worker is a few KiB; 4 MiB leaves room


def _warm(nice: int, modules: list[str], errors: list[str]) -> None:
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # this thread only (Linux: nice is per thread)
        except OSError:
            pass
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - the script's own import will say it properly
            errors.append(f"{name}: {exc!r}")
    # the preloaded modules outlive every round: move them out of the collector's reach now, off the
    # round's path (a script's first full collection, e.g. rounds()' gc.freeze(), scans only its own
    # objects then, not the hundreds of thousands that torch and TorchRec create)
    gc.collect()
    gc.freeze()


def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
    if not data:
        return None
    return json.loads(data), fds


def _take_over(message: dict, fds: list[int]) -> None:
    """The round's environment, working directory and (when redirected) stdout/stderr."""
    streams = [n for n, on in ((1, message.get("stdout")), (2, message.get("stderr"))) if on]
    for target, fd in zip(streams, fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    _apply_threads()


def _apply_threads() -> None:
    """The round's ``OMP_NUM_THREADS`` for a preloaded torch. The OpenMP runtime reads it once, when torch
    loads it: in the spare, before the agent (or torch's launcher, 1 per worker by default) set it, so a
    worker started from a spare ran its intra-op parallelism on every core of the machine, each worker of
    the node, where a new process honoured the variable."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # "4,2": the outer level
    if torch is None or not value.isdigit() or int(value) < 1:
        return
    try:
        torch.set_num_threads(int(value))
    except Exception:  # noqa: BLE001 - a torch without it (or a stub): the script runs as it is
        pass


def _run(argv: list[str]) -> None:
    """``python -u script.py ARGS`` or ``python -u -m module ARGS`` (the forms torchrun uses)."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        if not sys.flags.safe_path:
            sys.path.insert(0, os.getcwd())  # as `python -m`
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        # as `python script.py`: the directory of the script's real file (a symlinked script imports the
        # modules beside its target), none under -P / PYTHONSAFEPATH
        if not sys.flags.safe_path:
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main(fd: int, nice: int, modules: list[str]) -> None:
    if not sys.flags.safe_path:  # (under -P / PYTHONSAFEPATH Python added no directory of ours)
        del sys.path[0]  # this file's directory: its modules must not shadow others (http.py)
    sock = socket.socket(fileno=fd)
    errors: list[str] = []
    warm = threading.Thread(target=_warm, args=(nice, modules, errors), name="erm-spare-warm", daemon=True)
    warm.start()
    warm.join()
    try:
        sock.sendall(READY)
    except OSError:
        pass  # the agent handed us our round while we warmed up, and closed its end: the message waits
    try:
        received = _receive(sock)
    except OSError:
        received = None
    if received is None:
        return  # the agent is gone, or closed its pool: nothing to run
    message, fds = received
    sock.close()
    _take_over(message, fds)
    _run(message["argv"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [m for m in sys.argv[3].split(",") if m])
