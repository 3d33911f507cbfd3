"""A clone's virtualenv without installing anything: a thin venv over an installed one.

Why not a symlink to the installed venv: its editable install of ``elastic_rm`` points at the original
checkout, and ``PYTHONPATH`` (which would put the clone first) does not reach every process the suite
starts: not one started over ssh, nor one given a minimal environment. A venv of its own whose ``.pth``
lists the clone and then the installed venv's site-packages makes every process that runs the clone's
``.venv/bin/python`` import the clone's code and the installed dependencies, whatever its environment.
The installed venv's own ``.pth`` files are not read (their paths are plain ``sys.path`` entries here),
so its editable install does not come in. Sound while the clone's dependencies and entry points are the
installed venv's: its package metadata (entry points) is the installed one's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

STAMP = ".installed"  # the Makefile's setup stamp: `make test` does not re-run setup over this venv


def site_packages(python: Path) -> Path:
    """Where ``python`` installs packages (its venv's site-packages)."""
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(out.stdout.strip())


def package_dirs(python: Path) -> list[Path]:
    """Every site-packages directory ``python`` imports from, in order: its own, and for a venv made by
    :func:`overlay` (the suite's harness test runs the harness inside a run) the ones it lists."""
    code = "import sys; print('\\n'.join(p for p in sys.path if p.endswith('site-packages')))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return [Path(line) for line in out.stdout.splitlines() if line]


def overlay(installed: Path, target: Path, first: list[Path]) -> None:
    """A venv at ``target`` that imports ``first`` (in that order), then ``installed``'s packages; the
    installed venv's scripts, pointed at the new interpreter (binaries linked)."""
    subprocess.run(
        [str(installed / "bin" / "python"), "-m", "venv", "--without-pip", str(target)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    paths = [*first, *package_dirs(installed / "bin" / "python")]
    (site_packages(target / "bin" / "python") / "erm_repeat.pth").write_text("".join(f"{p}\n" for p in paths))
    shebang = f"#!{target / 'bin' / 'python'}\n".encode()
    for script in sorted((installed / "bin").iterdir()):
        made = target / "bin" / script.name
        if made.exists() or made.is_symlink() or not script.is_file():
            continue  # the new venv's own python and activate scripts
        content = script.read_bytes()
        first_line, _, rest = content.partition(b"\n")
        if first_line.startswith(b"#!") and str(installed).encode() in first_line:
            made.write_bytes(shebang + rest)
            made.chmod(0o755)
        else:
            os.symlink(script.resolve(), made)
    (target / STAMP).touch()
