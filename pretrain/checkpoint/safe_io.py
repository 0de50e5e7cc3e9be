"""Weights in and out without unpickling: sharded safetensors writing and guarded `.pt` reading.

Nothing omniloom loads is unpickled: weights travel as safetensors, and any `.pt` goes through
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import torch

from omniloom.model.pretrained import INDEX_NAME, SINGLE_NAME  # one definition of the export layout

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask: from /proc on Linux, else by setting it back at once (under a lock)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def honour_umask(paths) -> None:
    """Give each file the mode a plain `open()` would have: 0666 minus the umask.

    safetensors writes through a private temporary file and keeps its 0600, so a checkpoint or
    export would otherwise hold one file the group cannot read beside 0644 siblings."""
    mode = 0o666 & ~current_umask()
    for path in paths:
        try:
            if os.stat(path).st_mode & 0o777 != mode:
                os.chmod(path, mode)
        except OSError:  # another user's file on a shared filesystem: leave it as written
            pass


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '512MiB' -> 512*2**20, 1000 -> 1000."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read size '{text}'; write it like 500MB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit])


def save_sharded(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write `state_dict` as safetensors, one file when it fits under `max_shard_size`,
    otherwise `model-00001-of-0000N.safetensors` files plus `model.safetensors.index.json`.
    Tensors are written contiguous and unshared (safetensors refuses aliasing)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    metadata = {k: str(v) for k, v in (metadata or {}).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().to("cpu").contiguous().clone()
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += nbytes
    for stale in list(out_dir.glob("model*.safetensors")) + [out_dir / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        path = out_dir / SINGLE_NAME
        save_file(shards[0], str(path), metadata=metadata)
        honour_umask([path])
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata=metadata)
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    honour_umask(paths)
    index = {"metadata": {"total_size": sum(sizes), **metadata}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def safe_torch_load(path: str | Path, map_location: str = "cpu"):
    """`torch.load` that never runs pickled code: only tensors and plain containers load.
    A file carrying anything else is refused with a ValueError."""
    try:
        return torch.load(str(path), map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # torch raises UnpicklingError (or RuntimeError) for forbidden globals
        raise ValueError(
            f"refusing to load {path}: it holds objects other than tensors and plain containers "
            f"(weights_only load failed: {str(err).splitlines()[0][:200]})"
        ) from err
