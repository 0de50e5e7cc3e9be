"""Progress output shared by long commands (`data build`, training): a bar only where one can be
drawn, otherwise periodic log lines, so a run in a log file or a Slurm job is never silent."""

from __future__ import annotations

import os


def bar_wanted(stream) -> bool:
    """True when `stream` is a terminal that reports a width: a tqdm bar can be drawn there. A pipe,
    a log file, a pty of 0 columns (some CI runners) or COLUMNS=0 gets periodic lines instead."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    if os.environ.get("COLUMNS", "").strip() == "0":
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns != 0
    except (AttributeError, ValueError, OSError):  # no file descriptor: let tqdm decide
        return True


def hms(seconds: float) -> str:
    """1h02m03s, 2m03s or 3s."""
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
