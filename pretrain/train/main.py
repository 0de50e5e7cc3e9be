"""The training entry point: argparse, the run, failures reported in one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .args import add_train_args, config_from_args
from .guards import NonFiniteError
from .loop import close_process_group, run

log = logging.getLogger(__name__)


def build_arg_parser(prog: str = "python -m omniloom.pretrain.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an omniloom model. Launch with `accelerate launch [--config_file "
        "configs/accelerate/X.yaml] -m omniloom.pretrain.train --config configs/tiny.yaml [key=value ...]` "
        "for several processes; plain python runs one.")
    add_train_args(p)
    return p


def report_failure(line: str, code: int) -> int:
    """Tell the user why this rank stops and return its exit code. Under `omniloom launch` the
    line goes to the launcher (a file in OMNILOOM_LAUNCH_ERRORS), which prints one line for the
    whole job; otherwise this rank prints it."""
    folder = os.environ.get("OMNILOOM_LAUNCH_ERRORS")
    if folder and os.path.isdir(folder):
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(folder, f"rank{rank:05d}.txt"), "w") as fh:
            fh.write(f"{code}\n{line}\n")
    else:
        print(line, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point for `accelerate launch -m omniloom.pretrain.train` (and `omniloom launch`)."""
    # intermixed: options may also come after the preset and the overrides (--resume auto last)
    args = build_arg_parser().parse_intermixed_args(argv)
    # Rank 0 tells the story; the other ranks speak only to warn, and say who they are.
    rank = int(os.environ.get("RANK", "0"))
    from omniloom.pretrain.console import USER_ERRORS, setup_logging, user_error_line

    setup_logging(0 if rank == 0 else -1, prefix="" if rank == 0 else f"[rank {rank}] ")

    try:
        result = run(config_from_args(args), progress=not args.no_progress, overwrite=args.overwrite)
    except NonFiniteError as err:
        return report_failure(f"omniloom train: {err}", 3)
    except (*USER_ERRORS, OSError) as err:  # a full disk outside a checkpoint save (metrics, TensorBoard): one line too
        line = user_error_line(err)
        if line is None:
            raise
        return report_failure(f"omniloom train: {line}", 2)
    finally:
        close_process_group()
    log.info("finished at step %d (%s), %d tokens; last checkpoint %s", result.step, result.stopped_by,
             result.tokens_seen, result.last_checkpoint)
    return 0


