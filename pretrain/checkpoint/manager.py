"""Checkpoints that are either complete or invisible.

Layout of `run_dir/checkpoints/`:

    step_00000100/                      a complete checkpoint (only ever appears by rename)
        accelerate/                     model, optimizer, RNG of every rank (accelerator.save_state;
                                        FSDP2 runs write a sharded state dict there)
        data_rank00000.pt ...           the data pipeline state of every rank (covers its workers)
        trainer.pt                      step, tokens seen, scheduler, guard and spike-window state
        config.yaml                     the resolved run config
        COMPLETE                        written last, after every rank has finished its files
    .tmp-step_00000200/                 being written, or left behind by a killed run: never read

Every rank writes its own files into the temporary folder, hashing them as they are written
(pretrain/checkpoint/integrity.py); after the ranks agree that every write succeeded, rank 0 writes
`COMPLETE` (the file list, their sha256, step and world size), fsyncs and renames the folder
into place. A rename within one directory is atomic on POSIX filesystems, so a reader sees either
nothing or the whole checkpoint. A failed write (a full disk) removes the temporary folder and
leaves the checkpoints before it as they were. Before a checkpoint is read, its files are hashed
again and compared with the record. The run folder must be on a filesystem every rank shares (the
usual setup for multi-node runs); a `step_N` (or a file in it) that links out of the run folder is
never read, and never deleted through the link.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import torch

from omniloom.pretrain.console import DiskFullError, is_disk_full
from omniloom.pretrain.rundir import CHECKPOINT_CONFIG

from . import integrity
from .fit import ShapeMismatch, shape_mismatch
from .integrity import ChecksumMismatch
from .safe_io import honour_umask

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
MARKER = "COMPLETE"


# what accelerate writes for an FSDP model: a SHARDED_STATE_DICT folder (torch.distributed.checkpoint)
# or a FULL_STATE_DICT file
SHARDED_MODEL_DIR, FULL_FSDP_MODEL_FILE = "pytorch_model_fsdp_0", "pytorch_model_fsdp.bin"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def incomplete_reason(path: str | Path) -> str | None:
    """None when `path` is a finished checkpoint, else why not, in words a user can act on: no
    marker (the write was cut off), an unreadable marker, or a file the marker lists is missing
    (a folder copied or truncated by hand)."""
    path = Path(path)
    if not _STEP_RE.match(path.name):
        return "its name is not step_N"
    outside = link_out_of_run(path)
    if outside is not None:
        return outside
    if not path.is_dir():
        return "it is not a folder"
    marker = path / MARKER
    if not marker.exists():
        return f"no {MARKER} marker: the write was cut off"
    try:
        info = json.loads(marker.read_text())
        files = list(info.get("files", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return f"its {MARKER} marker is unreadable"
    missing = [rel for rel in files if not (path / str(rel)).exists()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"{missing[0]}{more} listed in its {MARKER} marker is missing (copied or truncated by hand?)"
    return None


def link_out_of_run(path: str | Path) -> str | None:
    """Why checkpoint folder `path` must not be read when it, or anything in it, is a symbolic link
    leading out of its run folder (`path/../..`); None when it stays inside. A checkpoint linked
    in from elsewhere would be followed on resume and could be another run's, or anyone's."""
    path = Path(path)
    root = Path(os.path.realpath(path.parent.parent))
    # os.path.realpath, not Path.resolve: a link loop is then just a path that leads nowhere
    # (Path.resolve raises RuntimeError on a loop in Python 3.11)
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(root) or not target.exists():
            return f"it is a link to {target}, outside the run folder {root} or nowhere"
    if not path.is_dir():
        return None
    for folder, dirs, files in os.walk(path):  # does not follow links into folders
        for name in dirs + files:
            p = Path(folder) / name
            if p.is_symlink():
                target = Path(os.path.realpath(p))
                if not target.is_relative_to(root) or not target.exists():
                    return f"{p.relative_to(path)} in it links to {target}, outside the run folder {root} or nowhere"
    return None


def remove_path(path: Path) -> None:
    """Delete a checkpoint folder; a link is removed itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def is_complete(path: str | Path) -> bool:
    """True when `path` is a finished checkpoint: a `step_N` folder holding a valid marker whose
    file list is all present (guards against a folder copied or truncated by hand)."""
    return incomplete_reason(path) is None


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first (by step number)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _STEP_RE.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def incomplete_checkpoints(ckpt_dir: str | Path, after_step: int = -1) -> list[tuple[Path, str]]:
    """`step_N` folders in `ckpt_dir` past `after_step` that are not complete, oldest first, each
    with why (`incomplete_reason`). Temporary `.tmp-` folders are not listed: they are never read."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        match = _STEP_RE.match(p.name)
        if match and int(match.group(1)) > after_step:
            reason = incomplete_reason(p)
            if reason is not None:
                found.append((p, reason))
    return sorted(found, key=lambda pr: step_of(pr[0]))


def describe_incomplete(found: list[tuple[Path, str]]) -> str:
    """'step_X (why)[, step_Y (why)...]' for `incomplete_checkpoints`' result, newest first."""
    return ", ".join(f"{p.name} ({reason})" for p, reason in reversed(found))


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None. Temporary and unmarked folders are ignored."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, ckpt_dir: str | Path) -> Path | None:
    """`""` -> None (fresh start); `"auto"` -> newest complete checkpoint or None;
    a path -> that checkpoint, which must be complete (and not linked in from elsewhere)."""
    if not resume:
        return None
    if resume == "auto":
        newest = latest_checkpoint(ckpt_dir)
        damaged = incomplete_checkpoints(ckpt_dir, step_of(newest) if newest is not None else -1)
        if damaged and newest is None:
            raise ValueError(f"checkpoint.resume=auto: {ckpt_dir} holds no complete checkpoint, only "
                             f"{describe_incomplete(damaged)}; restore the missing files, or move the folder away "
                             "to start afresh")
        if damaged:
            log.warning("checkpoint.resume=auto: resuming from %s, the newest complete checkpoint; skipping the newer "
                        "%s", newest.name, describe_incomplete(damaged))
        return newest
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint.resume={resume}: no such folder; use 'auto' or a step_N folder "
                                f"under {ckpt_dir}")
    linked = link_out_of_run(path) if _STEP_RE.match(path.name) else None
    if linked is not None:
        raise ValueError(f"refusing to resume from {path}: {linked}; copy the checkpoint into the run folder "
                         "instead of linking it, or resume from another one")
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"checkpoint {path} is incomplete ({reason}); pick an earlier one or use checkpoint.resume=auto")
    return path


def step_of(path: str | Path) -> int:
    match = _STEP_RE.match(Path(path).name)
    assert match, path
    return int(match.group(1))


class CheckpointManager:
    """Saves and restores full training state through an `accelerate.Accelerator`.

    `save(step, trainer_state, data_state, config_yaml)` is collective: every rank must call it.
    """

    def __init__(self, ckpt_dir: str | Path, accelerator, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.dir = Path(ckpt_dir)
        self.acc = accelerator
        self.keep_last = keep_last
        if self.acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
        self.acc.wait_for_everyone()

    def _remove_stale_tmp(self) -> None:
        for p in self.dir.glob(TMP_PREFIX + "*"):
            log.warning("removing incomplete checkpoint folder %s (a run was cut off while writing it)", p)
            try:
                remove_path(p)
            except OSError:
                shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, *, trainer_state: dict, data_state: dict | None, config_yaml: str) -> Path:
        """Write checkpoint `step` (collective). Returns the final folder.

        Every file is hashed as it is written; the digests go into COMPLETE. When a rank's write
        fails, every rank learns it before anything is renamed: the temporary folder is removed and
        all raise the same error (DiskFullError, one line, when the disk or quota is full), and the
        checkpoints saved before stay as they were."""
        t0 = time.perf_counter()
        name = checkpoint_name(step)
        final = self.dir / name
        tmp = self.dir / (TMP_PREFIX + name)
        rank = self.acc.process_index
        if self.acc.is_main_process:
            remove_path(tmp)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        digests = integrity.Digests(tmp)
        failure = None
        try:
            with integrity.hashing_saves(digests):
                # accelerate writes model + optimizer (rank 0, or shards under FSDP) and every rank's RNG.
                self.acc.save_state(str(tmp / "accelerate"))
                torch.save(data_state, tmp / f"data_rank{rank:05d}.pt")
                if self.acc.is_main_process:
                    torch.save(trainer_state, tmp / "trainer.pt")
                    digests.write_bytes(tmp / CHECKPOINT_CONFIG, config_yaml.encode("utf-8"))
        except Exception as err:  # noqa: BLE001 - every rank must hear of it before the rename
            failure = err
        self._agree_on_save(tmp, digests, failure)
        failed, cause = None, None
        if self.acc.is_main_process:
            try:
                final = self._publish(step, tmp, final, digests)
                log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
            except Exception as err:  # noqa: BLE001 - a full disk while writing COMPLETE
                failed, cause = _failure(rank, err, tmp), err
        if self.acc.num_processes > 1:  # rank 0's outcome, to every rank (and the barrier after the rename)
            from accelerate.utils import broadcast_object_list

            failed = broadcast_object_list([failed])[0]
        if failed is not None:
            self._raise_save_failure(tmp, [failed], cause)
        return final

    def _agree_on_save(self, tmp: Path, digests: "integrity.Digests", failure: BaseException | None) -> None:
        """Share each rank's outcome and digests; raise on every rank when any rank failed."""
        mine = None if failure is None else _failure(self.acc.process_index, failure, tmp)
        if self.acc.num_processes > 1:
            from accelerate.utils import gather_object

            shared = gather_object([(mine, digests.by_path)])
            failures = [f for f, _ in shared if f is not None]
            for _, by_path in shared:
                digests.by_path.update(by_path)
        else:
            failures = [mine] if mine is not None else []
        if failures:
            self._raise_save_failure(tmp, failures, failure)

    def _raise_save_failure(self, tmp: Path, failures: list, cause: BaseException | None):
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the cut-off write took
        last = latest_checkpoint(self.dir)
        intact = (f"the last complete checkpoint, {last.name}, is intact" if last is not None
                  else "no complete checkpoint was saved before it")
        rank, what, full = next((f for f in failures if f[2]), failures[0])
        if full:
            free = _free_bytes(self.dir)
            raise DiskFullError(
                f"disk full while saving checkpoint {tmp.name[len(TMP_PREFIX):]} into {self.dir}"
                + (f" ({_human(free)} free there)" if free is not None else "")
                + f"; {intact}. Free some space (or lower checkpoint.keep_last), then resume with --resume auto") from cause
        raise RuntimeError(f"saving checkpoint {tmp.name[len(TMP_PREFIX):]} into {self.dir} failed on rank {rank}: "
                           f"{what}; {intact}") from cause

    def _publish(self, step: int, tmp: Path, final: Path, digests: "integrity.Digests") -> Path:
        """Rank 0, after every rank wrote its files: hash what was not hashed while written, write
        COMPLETE, rename the folder into place, prune."""
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        honour_umask(tmp / f for f in files)  # safetensors leaves model.safetensors at 0600
        expected = {f"data_rank{r:05d}.pt" for r in range(self.acc.num_processes)}
        assert expected <= set(files), f"missing data state files: {expected - set(files)}"
        late = [f for f in files if f not in digests.by_path]  # e.g. FSDP2's DCP shards
        if late:
            log.debug("hashing %d file(s) written without a hashing writer: %s", len(late), late[:4])
        sums = {f: digests.by_path[f] for f in files if f in digests.by_path}
        sums.update(integrity.hash_files(tmp, late))
        marker = tmp / MARKER
        with open(marker, "w") as fh:
            json.dump({"step": step, "files": files, "world_size": self.acc.num_processes, "time": time.time(),
                       integrity.ALGORITHM: sums}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        remove_path(final)  # re-saving the same step (e.g. SIGTERM right after a periodic save); a link: only the link
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        try:
            self._prune(step)
        except Exception as err:  # noqa: BLE001 - the checkpoint is saved; pruning old ones is housekeeping
            log.warning("keep_last: could not prune older checkpoints in %s (%s); %s is saved", self.dir, err, final.name)
        return final

    def _prune(self, saved_step: int) -> None:
        # Only checkpoints up to the one just saved count: a fresh run in a folder that holds a
        # longer earlier run's checkpoints must not delete its own newest save for being "oldest".
        # A step_N that links out of the run folder counts as a checkpoint here: the link goes
        # (never what it points to), so keep_last holds.
        found = [p for p in self.dir.iterdir() if _STEP_RE.match(p.name) and step_of(p) <= saved_step
                 and (is_complete(p) or p.is_symlink())]
        found.sort(key=step_of)
        for old in found[: max(0, len(found) - self.keep_last)]:
            try:
                remove_path(old)
            except OSError as err:
                log.warning("keep_last: could not delete %s (%s)", old, err)

    def first_verified(self, path: Path, *, auto: bool) -> Path:
        """`path` once its files match the checksums recorded at save (collective). With `auto`
        (checkpoint.resume=auto), a damaged `path` gives way, with a warning, to the next older
        complete checkpoint that matches; a checkpoint given by name that does not match is
        refused."""
        candidates = [Path(path)]
        if auto:
            candidates += [p for p in reversed(list_checkpoints(self.dir)) if step_of(p) < step_of(path)]
        for i, candidate in enumerate(candidates):
            try:
                self.verify(candidate)
                return candidate
            except ChecksumMismatch as err:
                if i + 1 == len(candidates):
                    if i == 0:
                        raise
                    raise ChecksumMismatch(f"checkpoint.resume=auto: no checkpoint in {self.dir} matches its checksums; "
                                           f"the oldest: {err}", err.files) from err
                if self.acc.is_main_process:
                    log.warning("checkpoint.resume=auto: %s; resuming from the previous complete checkpoint, %s, "
                                "instead", err, candidates[i + 1].name)
        raise AssertionError("unreachable")

    def verify(self, path: str | Path) -> None:
        """Check every file of checkpoint `path` against the sha256 in its COMPLETE marker (collective:
        each rank hashes a share of the files). Raises ChecksumMismatch naming the files that
        differ; a checkpoint from before checksums is let through with a warning."""
        path = Path(path)
        rank, world = self.acc.process_index, self.acc.num_processes
        bad = _bad_files(path, lambda files: files[rank::world], warn=self.acc.is_main_process)
        if world > 1:
            from accelerate.utils import gather_object

            bad = sorted(f for part in gather_object([bad]) for f in part)
        if bad:
            raise mismatch_error(path, bad)

    def load(self, path: str | Path, *, note: str = "") -> tuple[dict, list]:
        """Restore model/optimizer/RNG into the prepared objects; return (trainer_state, the data
        states of every rank that wrote the checkpoint, in rank order): a data loader resuming on
        another layout pools them all (data/stream/elastic.py).

        Another world size is accepted: replicated model and optimizer (one process or DDP) load
        as saved, a sharded one (FSDP2, torch.distributed.checkpoint) is resharded by DCP as it
        loads. The ranks' RNG streams are restored only where a saved rank of the same index
        exists (the resume is no longer bit-exact; the data stream keeps every document once per
        epoch). A sharded checkpoint needs an FSDP run, a replicated one a run without FSDP. `note`
        ends the "resumed from" line (the global batch kept on another process count)."""
        path = Path(path)
        info = json.loads((path / MARKER).read_text())
        saved_world = info.get("world_size")
        if not isinstance(saved_world, int) or saved_world < 1:
            raise ValueError(f"checkpoint {path} has no valid world size in {MARKER} ({saved_world!r})")
        acc_dir = path / "accelerate"
        saved_fsdp = (acc_dir / SHARDED_MODEL_DIR).is_dir() or (acc_dir / FULL_FSDP_MODEL_FILE).is_file()
        if saved_fsdp != self.sharded():
            how = ("an FSDP checkpoint: resume it with an FSDP accelerate config (configs/accelerate/fsdp2.yaml "
                   "or ep_fsdp2_8gpu.yaml; any number of processes)"
                   if saved_fsdp else
                   "a replicated (single-process or DDP) checkpoint: resume it without FSDP (e.g. "
                   "configs/accelerate/multi_gpu.yaml), or start a fresh FSDP run")
            raise ValueError(f"checkpoint {path} is {how}; this run is {'FSDP' if self.sharded() else 'not FSDP'}")
        from safetensors import SafetensorError

        try:
            self.acc.load_state(str(path / "accelerate"))
            trainer_state = torch.load(path / "trainer.pt", weights_only=True)
            data_states = [torch.load(path / f"data_rank{r:05d}.pt", weights_only=True) for r in range(saved_world)]
        except (pickle.UnpicklingError, RuntimeError, EOFError, SafetensorError) as err:
            shapes = shape_mismatch(err)
            if shapes is not None:
                raise ShapeMismatch(path, shapes) from err
            raise ValueError(_unloadable_message(path, err)) from err
        self._check_rng_files(path, saved_world)
        log.info("resumed from %s (step %d)%s", path, trainer_state.get("step", -1), f"; {note}" if note else "")
        return trainer_state, data_states

    def sharded(self) -> bool:
        from accelerate.utils import DistributedType

        return self.acc.distributed_type == DistributedType.FSDP

    def _check_rng_files(self, path: Path, saved_world: int) -> None:
        """accelerate skips an unreadable `random_states_<rank>.pkl` with an INFO line and goes on
        with fresh RNG streams: the resumed run would silently stop being exact. Refuse instead.

        Every rank reads every saved rank's file, at any world size, so that a tampered or corrupt
        one is refused by all ranks alike even where this run would not restore it (a rank with no
        saved counterpart starts fresh streams, as `load` says). This rank's own file, where there
        is one, must also have been restored."""
        from accelerate.utils import load as acc_load

        own = None
        for rank in range(saved_world):
            rng_file = path / "accelerate" / f"random_states_{rank}.pkl"
            if not rng_file.exists():  # not listed in the marker by an older writer: nothing to restore
                continue
            try:
                states = acc_load(rng_file, map_location="cpu")
                if not isinstance(states, dict) or "torch_manual_seed" not in states or "random_state" not in states:
                    raise ValueError("not an RNG state (missing keys)")
            except Exception as err:  # a pickle payload, a truncated file, a missing key: all the same to the user
                raise ValueError(_unloadable_message(path, err, rng_file)) from err
            if rank == self.acc.process_index:
                own = rng_file, states
        if own is None:
            return
        rng_file, states = own
        try:
            ok = (torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
                  and random.getstate() == tuple(states["random_state"]))
        except Exception as err:  # noqa: BLE001 - malformed values: unreadable to the user
            raise ValueError(_unloadable_message(path, err, rng_file)) from err
        if not ok:
            raise ValueError(f"cannot resume from {path}: the RNG state in {rng_file.name} was not restored, so the "
                             "resumed run would not be exact; resume from another checkpoint")


def read_checksums(path: str | Path) -> dict[str, str] | None:
    """The sha256 per file recorded in a checkpoint's COMPLETE marker; None for a checkpoint written
    before checksums were recorded."""
    try:
        info = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    sums = info.get(integrity.ALGORITHM) if isinstance(info, dict) else None
    if not isinstance(sums, dict):
        return None
    return {str(k): str(v) for k, v in sums.items()}


def mismatch_error(path: Path, bad: list[str]) -> ChecksumMismatch:
    more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{'...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
    return ChecksumMismatch(f"checkpoint {path}: {bad[0]}{more} does not match the checksum recorded when it was "
                            "saved (damaged or changed since); resume from another checkpoint", bad)


def verify_files(path: str | Path, only: list[str] | None = None) -> None:
    """`CheckpointManager.verify` in one process, for readers without a process group (export,
    eval): the files `only` (relative paths; all by default) against the recorded checksums."""
    path = Path(path)
    pick = None if only is None else (
        lambda files: [rel for rel in files if any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in only)])
    bad = _bad_files(path, pick)
    if bad:
        raise mismatch_error(path, bad)


def _bad_files(path: Path, pick=None, *, warn: bool = True) -> list[str]:
    """The files of checkpoint `path` (those `pick` keeps of the sorted recorded names; all by
    default) whose sha256 differs from its COMPLETE marker; none for a checkpoint saved before
    checksums, which is let through (with a warning when `warn`)."""
    recorded = read_checksums(path)
    if recorded is None:
        if warn:
            log.warning("%s was saved by an older omniloom without checksums: its files cannot be verified", path)
        return []
    files = sorted(recorded)
    return integrity.mismatches(path, recorded, only=files if pick is None else pick(files))


def _failure(rank: int, err: BaseException, tmp: Path) -> tuple[int, str, bool]:
    """A rank's save failure as shared between ranks: (rank, description, whether the disk is full)."""
    return rank, _describe_error(err, tmp), is_disk_full(err) or _nearly_full(tmp)


def _describe_error(err: BaseException, where: Path) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return first.replace(str(where), "...") if first else type(err).__name__


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _nearly_full(path: Path) -> bool:
    """Less than 1 MiB free where `path` lies: torch's own writer reports a full disk without the
    errno ("unexpected pos"), so the free space says it."""
    free = _free_bytes(path)
    return free is not None and free < (1 << 20)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _unloadable_message(path: Path, err: BaseException, culprit: Path | None = None) -> str:
    """One line for a checkpoint file that cannot be loaded safely, naming the file."""
    from accelerate.utils import load as acc_load

    if culprit is None:  # find which file it was (only on this error path: files may be large)
        for f in sorted(path.rglob("*")):
            if f.is_file() and f.suffix == ".safetensors":
                try:
                    from safetensors import safe_open

                    with safe_open(str(f), framework="pt") as fh:
                        for key in fh.keys():
                            fh.get_slice(key)
                except Exception as e:  # noqa: BLE001 - a bad header, a truncated or a pickled file
                    culprit, err = f, e
                    break
            if f.is_file() and f.suffix in (".bin", ".pkl", ".pt"):
                try:
                    acc_load(f, map_location="cpu")
                except Exception as e:  # noqa: BLE001 - any failure names this file
                    culprit, err = f, e
                    break
    where = culprit.relative_to(path) if culprit is not None else "a file"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err) or "Unsupported global" in str(err):
        return (f"refusing to resume from {path}: {where} holds pickled objects other than tensors and plain data, "
                "which omniloom never writes (the file was tampered with or comes from elsewhere); resume from "
                "another checkpoint")
    return f"cannot resume from {path}: {where} is unreadable ({first}); resume from another checkpoint"
