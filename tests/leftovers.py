"""What a test session left behind: processes, temporary directories, node memory.

Every process the session starts inherits ``ERM_TEST_SESSION=<id>`` (children of children too, even after
they are re-parented to init), temporary directories go to a directory of the session's own (``TMPDIR``)
and node memory to a root of its own (``ELASTIC_RM_MEMORY_ROOT``). So a session counts only what it
started, never what a concurrent session (or a user's job) runs on the same machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elastic_rm.checkpoint.node_memory import ENV_MEMORY_ROOT
from elastic_rm.proc import kill_tree

ENV_SESSION = "ERM_TEST_SESSION"
WAIT_S = 15.0  # processes get this long to finish exiting (watchdogs clean up after their owners)
CACHES = ("torchinductor_",)  # kept across runs on purpose (torch's compile cache): not a leftover
# this pytest process's own: multiprocessing's temporary directory and helpers (a test used spawn or
# forkserver), which end with it; and pytest's base directory of a pytest run in a subprocess (kept by design)
OWN_TEMP = ("pymp-", "pytest-of-")
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def marked_processes(session: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries this session's mark, but this one."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(ENV_SESSION) != session or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.ppid() == os.getpid() and any(h in " ".join(p.cmdline()) for h in OWN_HELPERS):
                continue  # ends with this process
            found.append(p)
        except psutil.Error:
            continue
    return found


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


@dataclass
class SessionMarks:
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    tmp: Path | None = None
    memory: Path | None = None
    _saved: dict[str, str | None] = field(default_factory=dict)
    _saved_tempdir: str | None = None

    def enter(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"erm-test-{self.session}-"))
        self.memory = Path("/dev/shm") / f"erm-test-{self.session}"
        values = {ENV_SESSION: self.session, "TMPDIR": str(self.tmp), ENV_MEMORY_ROOT: str(self.memory)}
        for key, value in values.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        self._saved_tempdir = tempfile.tempdir
        tempfile.tempdir = str(self.tmp)

    def exit(self) -> list[str]:
        """Restore the environment, collect and remove what is left; the leftovers, described."""
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = self._saved_tempdir
        deadline = time.monotonic() + WAIT_S
        while (procs := marked_processes(self.session)) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = [f"process {_describe(p)}" for p in procs]
        for p in procs:
            kill_tree(p.pid)
        for root, what in ((self.tmp, "temporary"), (self.memory, "node memory")):
            if root is None or not root.exists():
                continue
            for p in sorted(root.iterdir()):
                if p.name.startswith(OWN_TEMP):
                    continue  # multiprocessing removes its own at exit
                if not p.name.startswith(CACHES):
                    leftovers.append(f"{what} {p}")
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            if not any(p.name.startswith("pymp-") for p in root.iterdir()):
                shutil.rmtree(root, ignore_errors=True)
        return leftovers
