"""Whether an export folder is whole, and putting a finished one in place.

`omniloom export` writes a new export into a staging folder beside `--out` (`.NAME.partial`) and
moves it into place only once every file is written: onto a free name with one rename, over an
existing export (`--force`) by exchanging the two folders in one step (Linux renameat2
RENAME_EXCHANGE; elsewhere two renames, between which the name is briefly absent, never half
written). A process killed meanwhile (SIGKILL, a full disk) leaves the previous export as it was
and the staging folder, which the next export removes. `incomplete_reason` is what the demo
asks before it counts an export as done: a folder from before this, or copied by hand, can still
be cut off. Light on imports (no torch): the demo calls it on every start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import struct
from pathlib import Path

CONFIG_NAME = "config.json"  # model/pretrained.py's name of the export's config


def staging_dir(out: Path) -> Path:
    """The folder an export of `out` is written into before it is moved into place."""
    return out.parent / f".{out.name}.partial"


def _link_or_copy(src, dst) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)  # no second copy of a large file; the old folder's name goes away after
    except OSError:
        shutil.copy2(src, dst)


def carry_other_files(old: Path, new: Path) -> None:
    """Bring the files of the old export folder that are not the export's (a user's notes, an
    eval.json) into the new one, as `--force` always kept them; the old weight files and index
    are the export's own and stay behind (a single-file export must not sit beside an old index)."""
    for entry in old.iterdir():
        name = entry.name
        if (new / name).exists() or os.path.lexists(new / name):
            continue
        if name == "model.safetensors.index.json" or (name.startswith("model") and name.endswith(".safetensors")):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / name)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the C
    library or the file system has no such call (the caller then renames twice)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def move_into_place(stage: Path, out: Path) -> None:
    """Put the finished export `stage` at `out`, replacing what is there only in one step."""
    from omniloom.data.manifest import fsync_dir  # the one directory fsync of the house

    if os.path.lexists(out) and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; choose a folder")
    if not out.exists():
        os.rename(stage, out)
    elif _exchange(stage, out):
        shutil.rmtree(stage, ignore_errors=True)  # now the old export
    else:
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(str(out.parent))


def _safetensors_whole(path: Path) -> str | None:
    """None when the file holds its whole header and every tensor's bytes, else what is wrong."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is cut off ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path.name} is cut off inside its header"
            header = json.loads(f.read(n))
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        return f"{path.name} cannot be read ({err})"
    if 8 + n + max(ends, default=0) != size:
        return f"{path.name} holds {size} bytes, its header says {8 + n + max(ends, default=0)}"
    return None


def incomplete_reason(folder: str | Path) -> str | None:
    """None when `folder` is a whole export: its config.json, every weight file it lists (with
    all their bytes), the index of a sharded one, the tokenizer files and the model card. Else the
    first thing missing or cut off."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
        weights, tokenizer = config["weights"], config["tokenizer"]
        files, index, tok_files = list(weights["files"]), weights.get("index"), list(tokenizer["files"])
    except FileNotFoundError:
        return f"{folder / CONFIG_NAME} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{folder / CONFIG_NAME} is not a whole export config ({err})"
    if not files:
        return f"{folder / CONFIG_NAME} lists no weight files"
    for name in [*tok_files, *([index] if index else []), "README.md"]:
        if not (folder / str(name)).is_file():
            return f"{folder / str(name)} is missing"
    for name in files:
        path = folder / str(name)
        if not path.is_file():
            return f"{path} is missing"
        why = _safetensors_whole(path)
        if why:
            return why
    return None
