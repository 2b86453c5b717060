"""Advisory file locks (flock) that the kernel releases when their holder dies, however it dies:
the run directory's (lss.engine.run_dir) and the synthetic generator's staging folder's. A lock file
left behind by a killed process is therefore never an obstacle."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_in_child() -> None:
    """A forked child (a loader worker, a render process) closes its copies of the held locks, so
    that it does not keep a lock alive after its parent died; the parent's lock stays held."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def try_lock(path: Path, note: str = "") -> Optional[int]:
    """Lock the file `path` (created if missing) for this process and write `note` into it; the
    lock's descriptor, or None when another process holds the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    _HELD.add(fd)
    return fd


def release(fd: int) -> None:
    """Release a lock of try_lock (closing its last descriptor releases the flock)."""
    _HELD.discard(fd)
    os.close(fd)
