"""A real OpenSSH server for the launch tests: loopback, a random port, throwaway keys, this user only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released: connecting is refused)."""
    return free_port()


def keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "erm-launch-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


class Sshd:
    """``sshd -D -e -f <own config>`` as the current user; stopped by its pid."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.host_key = root / "host_ed25519"
        self.user_key = root / "id_ed25519"
        keygen(self.host_key)
        keygen(self.user_key)
        (root / "authorized_keys").write_text(self.user_key.with_suffix(".pub").read_text())
        self.port = free_port()
        self.config = root / "sshd_config"
        self.config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {root / 'authorized_keys'}",
                    "PidFile none",
                    "UsePAM no",
                    "StrictModes no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "PermitRootLogin prohibit-password",
                    "MaxStartups 100",
                    "MaxSessions 100",
                    "LogLevel ERROR",
                ]
            )
            + "\n"
        )
        self.log_path = root / "sshd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Sshd:
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sshd did not listen on 127.0.0.1:{self.port} within 20 s")

    def ssh_flags(self) -> list[str]:
        """erm launch's ssh options for this server."""
        return [
            "--ssh-identity",
            str(self.user_key),
            "--ssh-port",
            str(self.port),
            "--ssh-option",
            "StrictHostKeyChecking=no",
            "--ssh-option",
            "UserKnownHostsFile=/dev/null",
            "--ssh-option",
            "LogLevel=ERROR",
        ]

    def kill_sessions(self) -> None:
        """Whatever runs through this server now (a test's leftovers), by the session processes' pids."""
        import psutil

        from elastic_rm.proc import kill_tree

        if self.proc is None:
            return
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return
        for child in children:
            kill_tree(child.pid)

    def stop(self) -> None:
        self.kill_sessions()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
