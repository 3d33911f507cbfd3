"""The spare pool against real spare processes (no agent): a spare runs a script as `python -u script.py`
would (``__main__``, argv, ``sys.path[0]``, exactly the environment handed to it, its redirected stdout
and stderr), also ``-m module``; a spare still warming at low priority is left for the next round; the
pool's close ends every waiting spare; bad ``--spare-preload`` values are clear errors."""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import pytest

from elastic_rm.agent.spares import SparePool, parse_preload, why_unsupported
from elastic_rm.guard import Watchdog

SCRIPT = """
import gc, json, os, sys
print(json.dumps({"frozen": gc.get_freeze_count(), "name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "pid": os.getpid(), "env": dict(os.environ), "cwd": os.getcwd(),
                  "json_loaded": "json" in sys.modules}))
print("err line", file=sys.stderr)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture
def pool():
    guard = Watchdog()
    p = SparePool(("json",), guard, label=("script.py",))
    yield p
    p.close()
    guard.release()


def _ready(pool: SparePool, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(1 for s in pool._spares if s.ready()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("spares not ready within 60 s")


def _run(pool: SparePool, argv: list[str], env: dict[str, str], tmp_path, cwd=None) -> tuple[int, dict, str]:
    spare = pool.take()
    assert spare is not None
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        old = os.getcwd()
        os.chdir(cwd or old)
        try:
            spare.hand(argv, env, stdout, stderr)
        finally:
            os.chdir(old)
    code = spare.proc.wait(60)
    return code, json.loads(out.read_text().splitlines()[0]), err.read_text()


def test_a_spare_runs_a_script_as_python_would(pool, tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    started = pool.fill(1, low_priority=False)
    assert len(started) == 1 and pool.pids() == started
    assert "script.py" in psutil.Process(started[0]).cmdline()  # labelled for ps / pgrep -f
    _ready(pool, 1)
    env = {"PATH": os.environ["PATH"], "RANK": "3", "EXIT": "7"}
    code, seen, err = _run(pool, [str(script), "a", "b"], env, tmp_path, cwd=str(tmp_path))
    assert code == 7 and err == "err line\n"
    assert seen["pid"] == started[0] and seen["name"] == "__main__"
    assert seen["argv"] == [str(script), "a", "b"] and seen["path0"] == str(tmp_path)
    assert seen["cwd"] == str(tmp_path) and seen["json_loaded"]
    assert seen["frozen"] > 0  # the preloaded imports are out of the collector's reach before the script
    assert {k: v for k, v in seen["env"].items() if k != "LC_CTYPE"} == env  # exactly what it was handed
    assert pool.pids() == [] and pool.used_pids == started


def test_a_spare_runs_a_module(pool, tmp_path):
    (tmp_path / "mod_s.py").write_text(SCRIPT)
    pool.fill(1, low_priority=False)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
    code, seen, _ = _run(pool, ["-m", "mod_s", "x"], env, tmp_path, cwd=str(tmp_path))
    assert code == 0 and seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "mod_s.py"), "x"] and seen["path0"] == str(tmp_path)


def test_a_low_priority_spare_is_used_once_ready_and_close_ends_the_rest(pool):
    pids = pool.fill(2, low_priority=True)
    assert pool.fill(2, low_priority=True) == []  # already full
    spares = list(pool._spares)
    if not any(s.ready() for s in spares):
        assert pool.take() is None  # still warming at nice 19: the round starts a new process instead
    _ready(pool, 2)
    assert pool.rss_bytes() > 2 * 2**20
    taken = pool.take()
    assert taken is not None and taken.pid in pids
    taken.kill()
    pool.close()
    assert all(s.proc.poll() is not None for s in spares)
    assert pool.fill(1, low_priority=False) == []  # a closed pool starts nothing


def test_a_spare_whose_owner_closes_its_socket_exits_0(pool):
    (pid,) = pool.fill(1, low_priority=False)
    spare = pool._spares[0]
    _ready(pool, 1)
    spare.sock.close()
    assert spare.proc.wait(30) == 0


@pytest.mark.parametrize(
    "text,message",
    [
        ("tor ch", "'tor ch' is not a module name"),
        ("torch,no_such_module_erm", "module 'no_such_module_erm' is not installed"),
        ("torch;json", "is not a module name"),
    ],
)
def test_bad_preload_values_are_clear_errors(text, message):
    with pytest.raises(ValueError, match="--spare-preload") as info:
        parse_preload(text)
    assert message in str(info.value)


def test_good_preload_values_parse():
    assert parse_preload(" torch, json.decoder ,") == ("torch", "json.decoder")


class _Spec:
    def __init__(self, entrypoint, args, numa_options=None):
        self.entrypoint, self.args, self.numa_options = entrypoint, args, numa_options


def test_what_can_start_from_spares():
    assert why_unsupported(_Spec(sys.executable, ("-u", "train.py", "--x"))) is None
    assert why_unsupported(_Spec(sys.executable, ("-u", "-m", "pkg.train"))) is None
    assert "--no-python" in why_unsupported(_Spec("/bin/echo", ("hi",)))
    assert "not `python -u" in why_unsupported(_Spec(sys.executable, ("train.py",)))
    assert "NUMA" in why_unsupported(_Spec(sys.executable, ("-u", "t.py"), numa_options=object()))
