"""SIGKILL a launcher with everything it started: torchrun (under accelerate launch) starts each
rank in a session of its own, so `os.killpg` on the launcher leaves the ranks (and their loader
workers) running. Tests that mean "kill -9 the whole run" use `kill_tree`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (torchrun starts the ranks in sessions of
    their own, so killing the launcher's process group leaves them running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A TCP port free right now, for `accelerate launch --main_process_port`: the default 29500
    may be held by another run on the machine, and accelerate then warns on stderr."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive_with(marker: str) -> list[str]:
    """Live (not zombie) processes whose command line mentions `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{proc.name} [{state}] {cmd[:160]}")
    return found


def still_alive(marker: str, within_s: float = 10.0) -> list[str]:
    """`alive_with(marker)` once they are all gone or `within_s` seconds have passed."""
    deadline = time.monotonic() + within_s
    while (alive := alive_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive
