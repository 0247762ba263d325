"""Files that several processes share (the jobs of a sweep on one data root, a requeued job, parallel evaluations):
a kernel lock per folder and JSON read with the file named (writes: mcar.atomic).

A kernel lock (`fcntl.flock`) is released by the kernel when its process dies, kill -9 included: no stale lock to
take over by hand, so no window where two processes both own a folder. A flock belongs to the open file, which a
forked child (a DataLoader worker) shares, so every forked child closes its copies at once: the lock dies with the
process that took it, not with its last child.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("mcar")


_TAKEN: set[FolderLock] = set()  # this process's held locks (held strongly: an open lock's fd must not be lost)


def _drop_inherited_locks() -> None:
    """In a forked child: close the parent's lock descriptors (the parent still holds its locks) and forget them."""
    for lock in list(_TAKEN):
        if lock.fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
    _TAKEN.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class FolderLock:
    """An exclusive kernel lock on `<folder>/<name>`; the file holds the owner (pid, host, start, ...) for messages
    and is removed on release. A process that locked a file another one removed meanwhile sees its inode gone and
    locks the new file instead, so two processes never both hold the lock."""

    def __init__(self, folder: str | Path, name: str = ".mcar.lock"):
        self.folder, self.path, self.fd = Path(folder), Path(folder) / name, None

    def acquire(self, blocking: bool = True, **owner) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # released and removed by its owner while we waited: lock the file there now
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                **owner}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        _TAKEN.add(self)
        return True

    @property
    def held(self) -> bool:
        return self.fd is not None

    def owner(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: a process waiting on this inode then sees it gone
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
            _TAKEN.discard(self)


@contextlib.contextmanager
def writing_into(folder: str | Path, what: str, lock_name: str = ".mcar-writer.lock"):
    """One writer of `what` into `folder` at a time: a second one waits (saying for whom), then finds the
    first one's finished work and skips it."""
    lock = FolderLock(folder, lock_name)
    if not lock.acquire(blocking=False, what=what):
        o = lock.owner()
        log.warning("%s: waiting for pid %s on %s (writing %s since %s)", folder, o.get("pid"), o.get("host"),
                    o.get("what", what), o.get("started"))
        lock.acquire(blocking=True, what=what)
    try:
        yield lock
    finally:
        lock.release()


def read_json(path: str | Path, what: str = "") -> dict | list:
    """json.loads of a file, a broken file named (what it is, how to mend it) instead of a bare JSONDecodeError."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        empty = " (empty: a write that was cut off?)" if path.stat().st_size == 0 else ""
        raise ValueError(f"{path} is not valid JSON{empty}: {e.msg} at line {e.lineno}; "
                         f"{what or 'delete it to have it rebuilt'}") from None
