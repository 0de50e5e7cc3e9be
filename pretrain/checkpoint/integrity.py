"""Checksums of checkpoint files, computed while the files are written, checked before they are read.

A checkpoint's `COMPLETE` marker records the sha256 of every file in it (`"sha256": {path:
digest}`). The digests come from the bytes on their way to the file: while a checkpoint is saved,
`hashing_saves` routes `torch.save`, accelerate's safetensors writer and the file streams of
torch.distributed.checkpoint (FSDP2's sharded saves) through `HashingWriter`, so the model,
optimizer, RNG, data and trainer files are hashed as they are written (on a helper thread, while
the bytes go to the file), not read back. A file some other writer put there (none today) is
hashed after the save, once.

`mismatches` re-hashes files (several at once: hashlib releases the GIL; each file read ahead of
its hashing) and names every file whose bytes differ from the record, which `omniloom train
--resume`, `omniloom export` and `omniloom eval RUN` refuse. A checkpoint written before checksums
existed (no `"sha256"` in its marker) loads with a warning that it cannot be verified. What this
costs at the large_1b size: BENCHMARKS.md (`python -m omniloom.pretrain.bench.integrity`).

No torch at import time: `omniloom --help` loads the CLI's error types from here.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256"
_CHUNK = 8 << 20


class ChecksumMismatch(ValueError):
    """A checkpoint file's bytes differ from the checksum recorded when it was written."""

    def __init__(self, message: str, files: list[str]):
        super().__init__(message)
        self.files = files


def new_hash():
    return hashlib.new(ALGORITHM)


_OVERLAP = 1 << 20  # writes this large are hashed on another thread while they go to the file
_hasher: list[ThreadPoolExecutor] = []


def _hash_thread() -> ThreadPoolExecutor:
    """One helper thread per process: hashlib and file I/O both release the GIL, so a large
    buffer is hashed there while the caller's thread writes (or reads) it."""
    if not _hasher:
        _hasher.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="omniloom-hash"))
    return _hasher[0]


class HashingWriter(io.RawIOBase):
    """A binary file opened for writing that hashes every byte written through it. A large write
    is hashed on a helper thread while it is written, so the save takes about the longer of
    writing and hashing, not their sum."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = new_hash()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _OVERLAP:
            hashed = _hash_thread().submit(self._hash.update, view)
            try:
                self._fh.write(view)  # a buffered file writes everything or raises
            finally:
                hashed.result()  # the caller may reuse its buffer once write returns
        else:
            self._fh.write(view)
            self._hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._fh.flush()

    def tell(self) -> int:  # only ever appended to: the position is the size (DCP asks)
        return self.size

    def fileno(self) -> int:
        return self._fh.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                super().close()  # flushes
            finally:
                self._fh.close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class Digests:
    """The digests of the files written under `root` while a checkpoint is saved (relative paths)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.by_path: dict[str, str] = {}

    def owns(self, path) -> str | None:
        """`path` relative to the root when it lies under it, else None."""
        try:
            p = Path(os.fspath(path)).resolve()
        except TypeError:
            return None
        return str(p.relative_to(self.root)) if p.is_relative_to(self.root) else None

    @contextlib.contextmanager
    def open(self, path):
        """A HashingWriter on `path` whose digest is recorded when it closes without error."""
        rel = self.owns(path)
        writer = HashingWriter(path)
        try:
            yield writer
        finally:
            writer.close()
        if rel is not None:
            self.by_path[rel] = writer.hexdigest()

    def write_bytes(self, path, data: bytes) -> None:
        with self.open(path) as fh:
            fh.write(data)

    def renamed(self, old, new) -> None:
        a, b = self.owns(old), self.owns(new)
        if a is not None and a in self.by_path:
            digest = self.by_path.pop(a)
            if b is not None:
                self.by_path[b] = digest


@contextlib.contextmanager
def hashing_saves(digests: Digests):
    """While active, `torch.save(obj, PATH)`, accelerate's safetensors writer and the file streams
    torch.distributed.checkpoint opens (FSDP2's sharded saves), for paths under `digests.root`,
    write through a HashingWriter and record the digest. Other paths are left alone. Only the
    process's own writes are touched (loader workers are other processes). Whatever is written
    some other way is hashed after the fact by the caller."""
    import torch
    from accelerate.utils import other as acc_other

    orig_save, orig_safe = torch.save, getattr(acc_other, "safe_save_file", None)
    try:
        from torch.distributed.checkpoint.filesystem import FileSystem
    except ImportError:  # pragma: no cover - a torch without DCP
        FileSystem = None
    orig_stream = getattr(FileSystem, "create_stream", None)
    orig_rename = getattr(FileSystem, "rename", None)

    @contextlib.contextmanager
    def create_stream(fs, path, mode):
        if "w" not in mode or digests.owns(path) is None:
            with orig_stream(fs, path, mode) as stream:
                yield stream
            return
        with digests.open(path) as stream:
            yield stream

    def rename(fs, path, new_path):
        orig_rename(fs, path, new_path)
        digests.renamed(path, new_path)

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and digests.owns(f) is not None:
            with digests.open(f) as fh:
                return orig_save(obj, fh, *args, **kwargs)
        return orig_save(obj, f, *args, **kwargs)

    def safe_save_file(tensors, filename, metadata=None):
        if digests.owns(filename) is None or orig_safe is None:
            return orig_safe(tensors, filename, metadata=metadata)
        with digests.open(filename) as fh:
            write_safetensors(tensors, fh, metadata)

    torch.save = save
    if orig_safe is not None:
        acc_other.safe_save_file = safe_save_file
    if orig_stream is not None and orig_rename is not None:
        FileSystem.create_stream, FileSystem.rename = create_stream, rename
    try:
        yield digests
    finally:
        torch.save = orig_save
        if orig_safe is not None:
            acc_other.safe_save_file = orig_safe
        if orig_stream is not None and orig_rename is not None:
            FileSystem.create_stream, FileSystem.rename = orig_stream, orig_rename


# ---- safetensors, streamed ----------------------------------------------------------------------
def _dtype_names() -> dict:
    import torch

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                       ("uint32", "U32"), ("uint64", "U64")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    return names


def write_safetensors(tensors: dict, fh, metadata: dict | None = None) -> None:
    """Write `tensors` (name -> CPU or device tensor) to the binary file `fh` in the safetensors
    format, one tensor at a time: no second copy of the whole state in memory (safetensors'
    save_file builds one), and every byte passes through `fh` (a HashingWriter hashes it).
    Tensors are laid out by element size, largest first, then by name, so each is aligned."""
    import torch

    names = _dtype_names()
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in names:
            raise ValueError(f"cannot write {name} ({t.dtype}) as safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for name in order:
        t = tensors[name].detach()
        if t.numel() == 0:
            continue
        t = t.to("cpu").contiguous().reshape(-1)
        fh.write(memoryview(t.view(torch.uint8).numpy()))


# ---- hashing and checking files ----------------------------------------------------------------
def hash_file(path: str | Path) -> str:
    """sha256 of a file; a helper thread reads the next chunk while this one hashes the last."""
    h = new_hash()
    bufs = [bytearray(_CHUNK), bytearray(_CHUNK)]
    with open(path, "rb", buffering=0) as fh, ThreadPoolExecutor(max_workers=1) as reader:
        n, i = fh.readinto(bufs[0]), 0
        while n:
            ahead = reader.submit(fh.readinto, bufs[(i + 1) % 2])
            h.update(memoryview(bufs[i % 2])[:n])
            n, i = ahead.result(), i + 1
    return h.hexdigest()


def hash_files(root: Path, rels: list[str], threads: int = 4) -> dict[str, str]:
    """sha256 of each `root/rel`, several files at once."""
    if not rels:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda rel: hash_file(root / rel), rels)))


def mismatches(root: str | Path, recorded: dict[str, str], only: list[str] | None = None, threads: int = 4) -> list[str]:
    """The files (relative paths) under `root` whose sha256 differs from `recorded`, or that are
    gone; restricted to `only` when given."""
    root = Path(root)
    rels = sorted(recorded if only is None else [r for r in only if r in recorded])
    present = [r for r in rels if (root / r).is_file()]
    bad = [r for r in rels if r not in present]
    got = hash_files(root, present, threads)
    return sorted(bad + [r for r in present if got[r] != recorded[r]])


__all__ = ["ALGORITHM", "ChecksumMismatch", "Digests", "HashingWriter", "hash_file", "hash_files", "hashing_saves",
           "mismatches", "write_safetensors"]
