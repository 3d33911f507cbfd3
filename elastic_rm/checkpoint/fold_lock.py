"""The names a fold in place leaves in a directory (its journal, its hidden base) and the lock that
serialises a fold with a restore's drop of newer steps in the same directory: the node's checkpoint
server folds a replica while a worker's restore may be dropping that replica's newer steps, and
without the lock a fold could rename its base to a step the drop had just removed. Both take an
exclusive fcntl lock on the directory itself (processes and threads alike; a crash releases it): a
lock file would be one more entry for every listing, copy and size of the directory to skip.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

JOURNAL = "fold.json"


def hidden_dirname(step: int) -> str:
    return f"fold-{step:08d}"


@contextmanager
def fold_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`'s fold lock (waiting for whoever holds it). Not re-entrant: never take it
    twice in one thread. A file system that cannot lock a directory (NFS emulates flock with locks
    that need a file open for writing) gets none: folds happen only in node memory, a local tmpfs,
    and a shared durable directory, where a restore also drops steps, never holds a fold."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


__all__ = ["JOURNAL", "fold_lock", "hidden_dirname"]
