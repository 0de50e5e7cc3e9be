"""An exclusive lock on an output folder, so two `data build` (or `data merge`) runs never write
into one folder at once, nor two trainings into one run folder (`omniloom.pretrain.train.runlock`).

The lock is a POSIX record lock (`fcntl.lockf`) on `DIR/.omniloom.lock`. The kernel drops it when
the holding process ends in any way, `kill -9` included, so a stale lock file never blocks a
rerun: the next holder takes it over and says whose it was. A record lock (not `flock`) because
it belongs to the process alone: the build's forked worker processes do not inherit it, so a
worker orphaned by a killed build cannot keep the folder locked; and because NFS passes record
locks to its lock service, so the lock holds across the hosts of a multi-node job. The file holds
a line naming the holder (what, pid, host, start time) for the refusal message; it is removed
when the holder releases the lock.

Where the filesystem has no lock service (ENOLCK and the like) the holder line alone decides: a
holder on this host that is still alive refuses, a dead one is taken over, one on another host
cannot be checked and refuses, saying which file to delete once that run is known to be over.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import time

LOCK = ".omniloom.lock"
log = logging.getLogger(__name__)

_HOLDER_RE = re.compile(r"\(pid (\d+) on host (\S+?),")


class OutputLocked(ValueError):
    """The output folder is locked by another running build, merge or training."""


class OutputLock:
    """Hold the lock on `directory` (created if needed) from construction to `release()`; a context
    manager. Raises OutputLocked, naming the holder, when another process holds it.

    what: this holder, as the refusal message of a later process names it ("data build into X");
    instead: the advice after "wait for it to finish" in that message."""

    def __init__(self, directory: str, what: str, *, instead: str = "or choose another --out"):
        self.path = os.path.join(directory, LOCK)
        self.directory, self.instead = directory, instead
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    self._without_lock_service(fd, err)
                    break
                os.close(fd)
                if err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise OutputLocked(self._refusal(_holder(self.path))) from None
            # The holder before us may have removed the file between our open and our lock: then
            # we locked an orphan inode, and must lock the file that is there now.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._note_leftover(_read_line(fd))
                break
            os.close(fd)
        self.fd = fd
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.pwrite(fd, f"{what} (pid {os.getpid()} on host {socket.gethostname()}, started {stamp})\n".encode(), 0)

    def _refusal(self, holder: str) -> str:
        return f"{self.directory} is in use by another running {holder}; wait for it to finish, {self.instead}"

    def _note_leftover(self, line: str) -> None:
        """We hold the lock and the file still names a holder: that process ended without releasing
        it (killed, or its host went down). Say so, unless it was this very process."""
        if not line:
            return
        pid, host = _parse_holder(line)
        if pid == os.getpid() and host == socket.gethostname():
            return  # this process locked the folder before (the same lock, taken again)
        log.warning("%s: taking over the lock of %s, which ended without releasing it (killed?)", self.directory, line)

    def _without_lock_service(self, fd: int, err: OSError) -> None:
        """No record locks on this filesystem: decide from the holder line alone."""
        line = _read_line(fd)
        pid, host = _parse_holder(line)
        if pid is not None and not (pid == os.getpid() and host == socket.gethostname()):
            if host != socket.gethostname():
                os.close(fd)
                raise OutputLocked(
                    f"{self._refusal(line)} (this filesystem cannot lock files, so whether that process still "
                    f"runs cannot be checked from here: once it is over, delete {self.path})")
            if _alive(pid):
                os.close(fd)
                raise OutputLocked(self._refusal(line))
            self._note_leftover(line)
        log.warning("cannot lock %s (%s): make sure no other process writes there at the same time",
                    self.directory, err.strerror)

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


def _read_line(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def _parse_holder(line: str) -> tuple[int | None, str | None]:
    m = _HOLDER_RE.search(line or "")
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return text or "process (it has not yet written its name)"
