"""An exclusive lock on an output folder, so two `data build` (or `data merge`) runs never write
into one folder at once.

The lock is a POSIX record lock (`fcntl.lockf`) on `DIR/.omniloom.lock`. The kernel drops it when
the holding process ends in any way, `kill -9` included, so a stale lock file never blocks a
rerun. A record lock (not `flock`) because it belongs to the process alone: the build's forked
worker processes do not inherit it, so a worker orphaned by a killed build cannot keep the
folder locked. The file holds a line naming the holder (pid, host, command, start time) for the
refusal message; it is removed when the holder releases the lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time

LOCK = ".omniloom.lock"
log = logging.getLogger(__name__)


class OutputLocked(ValueError):
    """The output folder is locked by another running build or merge."""


class OutputLock:
    """Hold the lock on `directory` (created if needed) from construction to `release()`; a context
    manager. Raises OutputLocked, naming the holder, when another process holds it."""

    def __init__(self, directory: str, what: str):
        self.path = os.path.join(directory, LOCK)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    # Some network file systems have no lock service: build unprotected, say so.
                    log.warning("cannot lock %s (%s): make sure no other build writes there at the same time", directory, err.strerror)
                    self.fd = fd
                    return
                os.close(fd)
                if err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise OutputLocked(
                    f"{directory} is in use by another running {_holder(self.path)}; wait for it to finish, "
                    "or choose another --out"
                ) from None
            # The holder before us may have removed the file between our open and our lock: then
            # we locked an orphan inode, and must lock the file that is there now.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.write(fd, f"{what} (pid {os.getpid()} on host {socket.gethostname()}, started {stamp})\n".encode())

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking, so no one locks a file that is going away
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing drops the record lock
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return text or "process (it has not yet written its name)"
