"""What every command shares on the console: the one-line user errors, logging set-up, the version."""

from __future__ import annotations

import errno
import logging


class DiskFullError(OSError):
    """The disk filled up while writing (errno ENOSPC or EDQUOT), said in one line."""


# DiskFullError: a checkpoint save that filled the disk says so in one line (the data is intact)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, DiskFullError)


def user_error_line(err: BaseException) -> str | None:
    """The one line for an error the user can act on (USER_ERRORS, or an OSError that is a full
    disk: metrics, TensorBoard, a shard), else None (a bug: let it raise)."""
    if isinstance(err, USER_ERRORS):
        return f"error: {err}"
    if isinstance(err, OSError) and is_disk_full(err):
        return f"error: disk full: {err}"
    return None


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("omniloom")
    except PackageNotFoundError:  # running from a tree that was never installed
        return "0+unknown"


def setup_logging(verbosity: int, *, prefix: str = "") -> None:
    """The console keeps to omniloom's own lines: at the default verbosity omniloom logs INFO and
    every other library (accelerate's lines per checkpoint, matplotlib's font cache, ...) only
    warnings; -v shows omniloom's DEBUG and the others' INFO, -vv everything; -q warnings only,
    -qq errors only. `prefix` starts every line (the rank, for ranks other than 0)."""
    own = {0: logging.INFO, 1: logging.DEBUG, -1: logging.WARNING}.get(verbosity, logging.DEBUG if verbosity > 0 else logging.ERROR)
    others = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG if verbosity > 1 else own)
    logging.basicConfig(level=others, format=prefix + "%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("omniloom").setLevel(own)


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or an error it came from) says the disk or the quota is full, by errno or by
    the OS wording. torch's own file writer reports a full disk as a bare RuntimeError ("...
    unexpected pos ..."), so a caller that gets another error also looks at the free space."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        err = err.__cause__ or err.__context__
    return False
