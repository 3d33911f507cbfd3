"""Security: etcd user/role auth (RBAC) limited to a run's prefix against a real etcd started with auth on,
half a TLS pair refused, run ids that cannot escape their prefix, the agent's HTTP endpoint on loopback
by default, and no module deserialising or executing data (AST scan)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdAuthError, EtcdConfigError
from elastic_rm.etcd.server import EtcdServer, find_etcd_binary
from elastic_rm.rendezvous.registration import create_handler
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import STEPS, ermrun_here, records
from tests.etcd.test_fork import _run

ERMRUN = os.path.join(BIN, "ermrun")
ROOT_PW, USER_PW = "root-pw-1", "alice-pw-2"


def etcdctl(endpoint: str, *args: str, user: str | None = None) -> str:
    ctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    argv = [ctl, f"--endpoints={endpoint}", "--dial-timeout=5s", "--command-timeout=10s"]
    if user:
        argv.append(f"--user={user}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")} | {"ETCDCTL_API": "3"}
    out = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, f"etcdctl {' '.join(args)}: {out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def auth_etcd():
    """A real etcd with auth on: root, a role read-write on the prefix /elastic-rm/job-a only (runs
    job-a*), user alice in it, and user bob whose role covers /elastic-rm/job-b only."""
    with EtcdServer() as server:
        ep = server.endpoint
        etcdctl(ep, "user", "add", f"root:{ROOT_PW}")
        etcdctl(ep, "user", "grant-role", "root", "root")
        for user, pw, run in (("alice", USER_PW, "job-a"), ("bob", USER_PW, "job-b")):
            etcdctl(ep, "role", "add", f"erm-{run}")
            etcdctl(
                ep,
                "role",
                "grant-permission",
                f"erm-{run}",
                "--prefix=true",
                "readwrite",
                f"/elastic-rm/{run}",
            )
            etcdctl(ep, "user", "add", f"{user}:{pw}")
            etcdctl(ep, "user", "grant-role", user, f"erm-{run}")
        etcdctl(ep, "auth", "enable")
        yield server


def test_client_with_a_prefix_role_reads_and_writes_only_its_prefix(auth_etcd):
    with EtcdClient(auth_etcd.endpoint, timeout=3, user="alice", password=USER_PW) as c:
        c.put("/elastic-rm/job-a/x", "1")
        assert c.get("/elastic-rm/job-a/x").value == b"1"
        with pytest.raises(EtcdAuthError, match="permission denied"):
            c.put("/elastic-rm/job-b/x", "1")
        with pytest.raises(EtcdAuthError, match="permission denied"):
            c.get("/elastic-rm/job-b/x")
    with pytest.raises(EtcdAuthError, match=auth_etcd.endpoint):
        with EtcdClient(auth_etcd.endpoint, timeout=3, user="alice", password="wrong") as c:
            c.get("/elastic-rm/job-a/x")
    with pytest.raises(EtcdConfigError, match="both a user and a password"):
        EtcdClient(auth_etcd.endpoint, user="alice")


def test_erm_commands_with_etcd_user_read_their_run(auth_etcd, monkeypatch):
    """erm status/events take ermrun's --etcd-user (password from $ELASTIC_RM_ETCD_PASSWORD)."""
    from elastic_rm.wire.records import RoundRecord, dumps
    from tests.e2e.test_erm_status import erm

    with EtcdClient(auth_etcd.endpoint, timeout=3, user="alice", password=USER_PW) as c:
        c.put("/elastic-rm/job-a-9/round", dumps(RoundRecord(round=3, members=("n0",), sealed=True)))
    args = ["--endpoint", auth_etcd.endpoint, "--run-id", "job-a-9", "--etcd-user", "alice"]
    monkeypatch.setenv("ELASTIC_RM_ETCD_PASSWORD", USER_PW)
    ok = erm("status", *args, "--json")
    assert ok.returncode == 0 and '"round": 3' in ok.stdout, ok.stderr + ok.stdout[:1500]
    assert erm("events", *args).returncode == 0
    monkeypatch.setenv("ELASTIC_RM_ETCD_PASSWORD", "wrong")
    bad = erm("status", *args)
    assert bad.returncode == 2 and auth_etcd.endpoint in bad.stderr, bad.stderr


def _params(endpoint: str, run: str, user: str, pw: str) -> RendezvousParameters:
    return RendezvousParameters(
        "elastic-rm", endpoint, run, 1, 1, local_addr="127.0.0.1", user=user, password=pw, lease_ttl="2"
    )


def test_handler_with_a_prefix_role_forms_a_round(auth_etcd):
    h = create_handler(_params(auth_etcd.endpoint, "job-a-1", "alice", USER_PW))
    try:
        info = h.next_rendezvous()
        assert info.rank == 0 and info.world_size == 1
    finally:
        h.shutdown()


def test_handler_of_another_prefix_is_a_clear_error(auth_etcd):
    with pytest.raises(RendezvousConnectionError) as err:
        h = create_handler(_params(auth_etcd.endpoint, "job-a-2", "bob", USER_PW))  # bob may use job-b only
        h.shutdown()
    text = str(err.value)
    assert "permission denied" in text and "/elastic-rm/job-a-2/" in text and "'bob'" in text, text


def _ermrun(tmp_path, name: str, args: list[str], env: dict[str, str], procs) -> Proc:
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": name, "STEPS_MAX": "3", **env}
    p = Proc([ERMRUN, "--monitor-interval", "0.1", *args, STEPS], str(tmp_path / f"{name}.log"), env=env)
    procs.append(p)
    return p


@pytest.mark.slow  # 13 s; CI keeps the prefix role's handler and erm commands above
def test_ermrun_with_etcd_user_runs_and_a_foreign_user_fails_clearly(auth_etcd, tmp_path, procs):
    common = ["--rdzv-endpoint", auth_etcd.endpoint, "--rdzv-id", "job-a-3", "--nproc-per-node", "1"]
    ok = _ermrun(
        tmp_path, "ok", [*common, "--etcd-user", "alice"], {"ELASTIC_RM_ETCD_PASSWORD": USER_PW}, procs
    )
    assert ok.wait(180) == 0, ok.output()[-3000:]
    assert [r for r in records(tmp_path, "ok") if r.get("step")], "the job trained"
    bad = _ermrun(
        tmp_path, "bad", [*common, "--etcd-user", "bob"], {"ELASTIC_RM_ETCD_PASSWORD": USER_PW}, procs
    )
    rc = bad.wait(120)
    out = bad.output()
    assert rc != 0 and "permission denied" in out and "Traceback" not in out, out[-3000:]
    nopw = _ermrun(
        tmp_path, "nopw", [*common, "--etcd-user", "alice"], {"ELASTIC_RM_ETCD_PASSWORD": ""}, procs
    )
    rc = nopw.wait(120)
    assert rc != 0 and "without a password" in nopw.output(), nopw.output()[-3000:]


@pytest.fixture
def steps_env(tmp_path, monkeypatch):
    """What _ermrun gives its process: a worker that started would log under tmp_path."""
    for name, value in {"STEPS_DIR": str(tmp_path), "STEPS_NODE": "tls", "STEPS_MAX": "3"}.items():
        monkeypatch.setenv(name, value)


# in this process (ermrun_here): no ~4 s torch import each
@pytest.mark.parametrize(
    "flags,message",
    [(["--etcd-cert", "/dev/null"], "--etcd-key"), (["--etcd-key", "/dev/null"], "--etcd-cert")],
)
def test_half_a_tls_pair_is_refused_before_anything_starts(
    etcd, run_id, tmp_path, capfd, steps_env, flags, message
):
    rc = ermrun_here(
        ["--monitor-interval", "0.1", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, *flags, STEPS]
    )
    out = capfd.readouterr().err
    assert rc == 2 and message in out and "Traceback" not in out, out[-3000:]
    assert records(tmp_path, "tls") == []  # no worker started
    with EtcdClient(etcd.endpoint) as c:
        assert c.get_prefix(f"/elastic-rm/{run_id}/")[0] == []  # nothing registered


# in this process (ermrun_here): every id end to end; the keyspace level is checked below as well
@pytest.mark.parametrize("run", ["../x", "/", "a/../../b"])
def test_a_run_id_cannot_escape_its_prefix(etcd, tmp_path, capfd, steps_env, run):
    with EtcdClient(etcd.endpoint) as c:
        _, before = c.get_prefix("/")
        rc = ermrun_here(
            ["--monitor-interval", "0.1", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run, STEPS]
        )
        out = capfd.readouterr().err
        assert rc == 2 and "invalid run id" in out and "Traceback" not in out, out[-3000:]
        kvs, _ = c.get_prefix("/")
        assert not [kv.key for kv in kvs if kv.mod_revision > before], "ermrun wrote to etcd"


def test_node_id_and_prefix_cannot_escape_either():
    from elastic_rm.wire.keyspace import Keyspace, validate_name

    for bad in ("../x", "..", "/", "a/../../b", "x/y", ".hidden", "a b", "a\nb", "é", "x" * 129, "a\x00b"):
        with pytest.raises(ValueError, match="invalid run id"):
            Keyspace("/elastic-rm", bad)

    for bad in ("../n", "n/../../x", "/", "..", "", "a\x00b"):
        with pytest.raises(ValueError, match="invalid node id"):
            validate_name("node id", bad)
    for bad in ("rel/ative", "/a/../b", "/a//b", "/a/./b"):
        with pytest.raises(ValueError, match="invalid etcd key prefix"):
            Keyspace(bad, "run")


def test_agent_http_endpoint_binds_to_loopback_unless_told():
    import socket

    from elastic_rm.agent.http import AgentHttpServer
    from elastic_rm.obs.metrics import AgentMetrics
    from launcher.ermrun import build_parser

    assert build_parser().parse_args(["--metrics-port", "9999", "x.py"]).metrics_host == "127.0.0.1"
    told = build_parser().parse_args(["--metrics-port", "9999", "--metrics-host", "0.0.0.0", "x.py"])
    assert told.metrics_host == "0.0.0.0"
    for host, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kwargs = {} if host is None else {"host": host}
        with AgentHttpServer(AgentMetrics("n"), port, **kwargs) as srv:
            assert srv.address is not None and srv.address[0] == expected


# -- no deserialisation or execution of data -----------------------------------------------------------------

FORBIDDEN_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
    "yaml",
}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile"}
PICKLING_APIS = {  # torch APIs that pickle what they send or read
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


# The one module that may import pickle: it subclasses pickle.Unpickler with a find_class that admits only
# DCP's metadata classes (torch's DCP stores .metadata as a pickle). It may use nothing else of pickle.
RESTRICTED_UNPICKLER = "elastic_rm/checkpoint/dcp_metadata.py"
RESTRICTED_UNPICKLER_USES = {"Unpickler"}


def _violations(path: pathlib.Path, name: str | None = None) -> list[str]:
    """What `path` does that deserialises or executes data; `name`: its path in the repository."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    name = name or path.relative_to(REPO).as_posix()
    restricted = name == RESTRICTED_UNPICKLER
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if restricted and isinstance(node, ast.Import) and [a.name for a in node.names] == ["pickle"]:
            continue  # checked use by use below
        if restricted and isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "pickle":
            if node.attr not in RESTRICTED_UNPICKLER_USES:
                found.append(f"{where}: pickle.{node.attr} (only pickle.Unpickler is allowed here)")
            continue
        if isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if isinstance(f, ast.Name) and name in FORBIDDEN_CALLS:
                found.append(f"{where}: {name}()")
            if name in PICKLING_APIS:
                found.append(f"{where}: {name}() pickles")
            if name == "load" and isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "torch":
                safe = any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords
                )
                if not safe:
                    found.append(f"{where}: torch.load without weights_only=True")
            if any(
                k.arg == "allow_pickle" and getattr(k.value, "value", None) is True for k in node.keywords
            ):
                found.append(f"{where}: allow_pickle=True")
    return found


def test_no_module_deserialises_or_executes_data():
    dirs = ("elastic_rm", "launcher", "benchmarks", "examples")
    files = sorted(p for d in dirs for p in (pathlib.Path(REPO) / d).rglob("*.py"))
    assert len(files) > 30
    bad = [v for p in files for v in _violations(p)]
    assert bad == [], "\n".join(bad)


def test_the_restricted_unpickler_module_may_use_only_the_unpickler(tmp_path):
    """dcp_metadata.py is exempt from the pickle import rule only for pickle.Unpickler; and its
    Unpickler subclass must override find_class (otherwise it would admit every global)."""
    path = pathlib.Path(REPO) / RESTRICTED_UNPICKLER
    assert _violations(path) == []
    tree = ast.parse(path.read_text())
    subclasses = [
        c
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and any(ast.unparse(b) == "pickle.Unpickler" for b in c.bases)
    ]
    assert subclasses and all(
        any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in c.body) for c in subclasses
    )
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\npickle.loads(b'')\nx = pickle.Unpickler\n")
    assert [v.split(": ", 1)[1] for v in _violations(probe, RESTRICTED_UNPICKLER)] == [
        "pickle.loads (only pickle.Unpickler is allowed here)"
    ]
    assert [v.split(": ", 1)[1] for v in _violations(probe, "elastic_rm/other.py")] == ["import pickle"]


def test_the_scan_catches_what_it_looks_for(tmp_path):
    probe = pathlib.Path(REPO) / "tests" / "chaos" / "_probe_scan.py"
    probe.write_text(
        "import pickle\nfrom marshal import loads\nimport torch\neval('1')\n"
        "torch.load('x')\ndist.broadcast_object_list([1])\nnp.load('x', allow_pickle=True)\n"
    )
    try:
        assert len(_violations(probe)) == 6
    finally:
        probe.unlink()


def _auth_child_work(endpoint: str) -> tuple:
    out = []
    with EtcdClient(endpoint, timeout=3, user="alice", password=USER_PW) as c:
        c.put("/elastic-rm/job-a/forked", "1")
        out.append((c.transport, c.get("/elastic-rm/job-a/forked").value))
        try:
            c.put("/elastic-rm/job-b/x", "1")
        except EtcdAuthError as exc:
            out.append(("denied", "permission denied" in str(exc)))
    try:
        EtcdClient(endpoint, timeout=3, user="alice", password="wrong").get("/elastic-rm/job-a/forked")
    except EtcdAuthError as exc:
        out.append(("refused", endpoint in str(exc)))
    return tuple(out)


def test_a_forked_child_authenticates_over_the_gateway(auth_etcd):
    """Forked while this process holds a client: the child's gateway transport sends the user's token, and
    etcd's refusals are the same EtcdAuthError."""
    with EtcdClient(auth_etcd.endpoint, timeout=3, user="alice", password=USER_PW) as parent:
        parent.put("/elastic-rm/job-a/parent", "p")
        got = _run("fork", _auth_child_work, auth_etcd.endpoint)
    assert got == ("ok", (("gateway", b"1"), ("denied", True), ("refused", True))), got
