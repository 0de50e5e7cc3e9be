"""glibc's allocator policy for CPU runs: keep freed memory in the process.

PyTorch's CPU allocator is plain malloc. glibc serves a block of 128 KiB or more (past its
adaptive threshold, up to 32 MiB) with a fresh mmap and unmaps it on free, and trims the heap's
top when it frees; the next step's tensors of the same sizes then fault their pages in again, one
4 KiB page at a time, and the kernel zeroes each. A training step that allocates and frees the
same large buffers every step pays those faults every step, and what they cost depends on the
machine: on a VM under memory pressure (a balloon or a reclaim daemon) they grew the Hugging Face
Qwen3-MoE step of `omniloom bench hf` by 1.4x, from 0.52 to 0.73 s (fill_ of fresh zeros: 28 ->
200 ms over two steps), while omniloom, whose largest buffers are pooled, moved 1-8%.

`keep_freed_memory()` turns that off for this process: no mmap for large blocks (they come from
the heap) and no trimming, so freed memory is reused without faults. The process holds its peak
heap until it exits, which a training loop reaches after its first steps anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("omniloom.malloc")

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
TOP_PAD_BYTES = 64 * 2**20  # grow the heap in steps of at least this much


def keep_freed_memory() -> bool:
    """Ask glibc to serve every block from the heap and never give memory back to the OS. Returns
    whether it took effect (False off Linux / glibc: nothing is changed there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, TOP_PAD_BYTES)))
    if not ok:
        log.warning("mallopt refused a setting: the allocator policy is unchanged or partly changed")
    return ok
