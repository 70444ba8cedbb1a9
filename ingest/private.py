"""Files that hold users' data (the SQLite database, the gateway's telemetry spool, the Undertow home):
readable by their owner only, whatever the process umask.

Directories are made 0700 and files 0600 when they are created. An existing path keeps its mode: it may
be a volume an operator set up, and tightening it is theirs to do (docs/operating.md, "Secrets").
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) if needed; a directory created here is 0700."""
    if not path.exists():
        path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask; this one is not
    return path


def private_file(path: Path) -> Path:
    """Create ``path`` empty and 0600 if missing (SQLite then gives its -wal and -shm files the same mode)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return path
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    return path
