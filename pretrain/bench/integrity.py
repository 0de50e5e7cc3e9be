"""What checkpoint checksums cost: hashing while saving, and verifying before a resume.

    python -m omniloom.pretrain.bench.integrity --dir /scratch/bench [--preset large_1b --ranks 8] [--state-gib 1] [--repeats 3]

1. sha256 in memory (the ceiling for everything below).
2. One file the size of one rank's share of the preset's checkpoint (fp32 weights plus AdamW's two
   moments, 12 bytes per parameter, over `--ranks` FSDP2 ranks, each of which writes and verifies
   its own share): written plainly, written through the hashing writer the save uses, and hashed
   back the way a resume verifies it. The ratios are what a save gains in time from hashing, and
   what a verify costs against the save.
3. A `--state-gib` state dict saved the ways a checkpoint is written (torch.save to a path vs
   through the hashing writer; safetensors' save_file vs the streamed writer), to show the writers
   themselves add nothing beyond the hash.

Every figure is measured in this run on this machine; a cold page cache (a resume after a reboot)
reads from the disk, so the verify line says whether the cache could be dropped first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

_CHUNK = 64 << 20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(path: Path) -> bool:
    """Evict `path` from the page cache (POSIX_FADV_DONTNEED after an fsync); True if the OS took it."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (AttributeError, OSError):
        return False


def checkpoint_bytes(preset: str, vocab: int = 32768) -> int:
    """fp32 weights + two fp32 AdamW moments for every parameter of `preset`."""
    from omniloom.model import accounting
    from omniloom.pretrain.config.run import load_config

    cfg = load_config(preset, [f"model.vocab_size={vocab}", "model.patch_token_id=8"]).model
    return 12 * accounting.num_params(cfg)


def _write(path: Path, size: int, block: memoryview, hashing: bool) -> float:
    from omniloom.pretrain.checkpoint.integrity import HashingWriter

    t0 = time.perf_counter()
    fh = HashingWriter(path) if hashing else open(path, "wb")  # noqa: SIM115
    with fh:
        left = size
        while left > 0:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n
    _fsync(path)
    return time.perf_counter() - t0


def bench(out_dir: Path, *, file_bytes: int, state_bytes: int, repeats: int = 3) -> list[str]:
    import torch

    from omniloom.pretrain.checkpoint.integrity import Digests, HashingWriter, hash_file, write_safetensors

    lines = []
    buf = os.urandom(_CHUNK)
    t0 = time.perf_counter()
    reps = 16
    h = hashlib.sha256()
    for _ in range(reps):
        h.update(buf)
    mem_rate = reps * _CHUNK / (time.perf_counter() - t0)
    lines.append(f"sha256 in memory, one thread: {mem_rate / 1e9:.2f} GB/s")

    block = memoryview(buf)
    path = out_dir / "shard.bin"
    plain, hashed, cold, warm, dropped = [], [], [], [], True
    for _ in range(repeats):  # alternated, so that neither gets the quieter disk
        plain.append(_write(path, file_bytes, block, hashing=False))
        path.unlink()
        hashed.append(_write(path, file_bytes, block, hashing=True))
        dropped = _drop_cache(path) and dropped
        t0 = time.perf_counter()
        hash_file(path)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hash_file(path)
        warm.append(time.perf_counter() - t0)
        path.unlink()
    t_plain, t_hashed, t_verify, t_warm = map(statistics.median, (plain, hashed, cold, warm))
    gb = file_bytes / 1e9
    lines += [
        f"one rank's file, {gb:.2f} GB (medians of {repeats}):",
        f"  write + fsync, plain:               {t_plain:7.1f} s  ({gb / t_plain:.2f} GB/s)",
        f"  write + fsync, hashed as written:   {t_hashed:7.1f} s  ({gb / t_hashed:.2f} GB/s), "
        f"{t_hashed / t_plain:.2f}x the plain write",
        f"  verify (read + sha256), {'page cache dropped' if dropped else 'page cache NOT dropped'}: "
        f"{t_verify:7.1f} s  ({gb / t_verify:.2f} GB/s), {t_verify / t_hashed:.2f}x the hashed save",
        f"  verify, file in the page cache:     {t_warm:7.1f} s  ({gb / t_warm:.2f} GB/s)",
    ]

    n = max(1, state_bytes // 4 // (64 << 20))  # tensors of 64 Mi floats
    state = {f"t{i}": torch.rand(min(64 << 20, state_bytes // 4)) for i in range(n)}
    sb = sum(t.numel() * 4 for t in state.values()) / 1e9
    names = ("torch.save(path)", "torch.save(hashing writer)", "safetensors save_file", "streamed safetensors, hashed")
    timings: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for k, name in enumerate(names):
            p = out_dir / f"state-{k}"
            t0 = time.perf_counter()
            if name == "torch.save(path)":
                torch.save(state, p)
            elif name == "torch.save(hashing writer)":
                with HashingWriter(p) as fh:
                    torch.save(state, fh)
            elif name == "safetensors save_file":
                from safetensors.torch import save_file

                save_file(state, str(p))
            else:
                digests = Digests(out_dir)
                with digests.open(p) as fh:
                    write_safetensors(state, fh)
            _fsync(p)
            timings[name].append(time.perf_counter() - t0)
            p.unlink()
    lines.append(f"a {sb:.2f} GB state dict, saved + fsync (medians of {repeats}):")
    for name in names:
        t = statistics.median(timings[name])
        lines.append(f"  {name:32s} {t:6.2f} s  ({sb / t:.2f} GB/s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder); use the checkpoint disk")
    p.add_argument("--preset", default="large_1b")
    p.add_argument("--ranks", type=int, default=8, help="FSDP2 ranks sharing the checkpoint (default 8)")
    p.add_argument("--file-gib", type=float, default=0.0, help="size of the file instead (default: one rank's share)")
    p.add_argument("--state-gib", type=float, default=1.0, help="size of the state dict for the writer comparison")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each (medians are printed)")
    args = p.parse_args(argv)
    total = checkpoint_bytes(args.preset)
    share = int(args.file_gib * 2**30) if args.file_gib else total // max(1, args.ranks)
    print(f"{args.preset}: {total / 1e9:.1f} GB of checkpoint (fp32 weights + AdamW moments, 32k vocabulary), "
          f"{total / max(1, args.ranks) / 1e9:.2f} GB per rank over {args.ranks} rank(s); measuring a {share / 1e9:.2f} GB file "
          f"on {os.cpu_count()} core(s), load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="omniloom-bench-integrity-") as tmp:
        for line in bench(Path(tmp), file_bytes=share, state_bytes=int(args.state_gib * 2**30), repeats=args.repeats):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
