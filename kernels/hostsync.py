"""Find host syncs and data-dependent shapes in a region of PyTorch code.

On a GPU, an op that reads device memory back to the host (`.item()`, `bool(t)`, `.tolist()`)
or whose output size depends on the data (`nonzero`, boolean-mask indexing, `unique`,
`repeat_interleave` without `output_size`, `bincount`) blocks the CPU until the GPU queue drains:
the launch queue runs dry and the GPU idles. `HostSyncRecorder` is a `TorchDispatchMode` that
records every such op run inside it, with the first omniloom frame that called it, on any device
(so a CPU test can prove that a GPU step makes none):

    with HostSyncRecorder() as rec:
        out = model(**batch); out.loss.backward()
    assert not rec.events, rec.report()

`_assert_async` (a device-side check with no host read) and `nonzero_static` are allowed.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a value back to the host, or whose output shape depends on the data
_SYNC_PACKETS = {
    "_local_scalar_dense": "reads a scalar back to the host (.item(), bool(), int(), float())",
    "is_nonzero": "reads a scalar back to the host (bool())",
    "equal": "returns a Python bool (reads back)",
    "nonzero": "data-dependent shape",
    "nonzero_numpy": "data-dependent shape",
    "argwhere": "data-dependent shape",
    "masked_select": "data-dependent shape",
    "_unique": "data-dependent shape",
    "_unique2": "data-dependent shape",
    "unique_dim": "data-dependent shape",
    "unique_consecutive": "data-dependent shape",
    "unique_dim_consecutive": "data-dependent shape",
    "bincount": "output size read from the data on CUDA",
    "histc": "reads min/max back on CUDA when min == max",
}


@dataclass
class SyncEvent:
    op: str
    why: str
    where: str  # first omniloom frame (file:line function), or the innermost frame


def _bool_index(indices) -> bool:
    return any(t is not None and isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices)


def _why(func, args, kwargs) -> str | None:
    packet = func._overloadpacket.__name__
    if packet in _SYNC_PACKETS:
        return _SYNC_PACKETS[packet]
    if packet == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if (isinstance(repeats, torch.Tensor) or func.__name__.endswith("Tensor")) and kwargs.get("output_size") is None:
            if not (len(args) > 3 and args[3] is not None):
                return "repeat_interleave with tensor repeats and no output_size: data-dependent shape"
    if packet == "index" and len(args) > 1 and _bool_index(args[1]):
        return "boolean-mask indexing: data-dependent shape"
    if packet in ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put") and len(args) > 1 and _bool_index(args[1]):
        return "boolean-mask assignment: data-dependent shape"
    return None


def _where() -> str:
    frames = traceback.extract_stack()[:-3]
    for fr in reversed(frames):
        if "omniloom" in fr.filename.replace("\\", "/") or "/model/" in fr.filename or "/kernels/" in fr.filename:
            if not fr.filename.endswith("hostsync.py"):
                return f"{fr.filename}:{fr.lineno} {fr.name}"
    fr = frames[-1] if frames else None
    return f"{fr.filename}:{fr.lineno} {fr.name}" if fr else "?"


class HostSyncRecorder(TorchDispatchMode):
    """Records host syncs and data-dependent shapes (see the module docstring). `.tolist()`
    bypasses the dispatcher, so it is caught by wrapping `torch.Tensor.tolist` while active."""

    def __init__(self):
        super().__init__()
        self.events: list[SyncEvent] = []
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None:
            self.events.append(SyncEvent(str(func), why, _where()))
        return func(*args, **kwargs)

    def __enter__(self):
        original = torch.Tensor.tolist
        rec = self

        def tolist(t, *a, **k):
            rec.events.append(SyncEvent("Tensor.tolist", "reads the tensor back to the host", _where()))
            return original(t, *a, **k)

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def report(self) -> str:
        """One line per event: op, why, where."""
        return "\n".join(f"{e.op}: {e.why} at {e.where}" for e in self.events) or "no host syncs"
