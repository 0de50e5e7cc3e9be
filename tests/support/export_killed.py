"""`omniloom export ARGS...` that SIGKILLs its own process once the weight files are written and
before the rest of the export is (tests/pretrain/test_export.py: an interrupted `export --force`)."""

from __future__ import annotations

import os
import signal
import sys

from omniloom.pretrain.export import write

_save_sharded = write.save_sharded


def _save_then_die(*args, **kwargs):
    files = _save_sharded(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return files


write.save_sharded = _save_then_die

if __name__ == "__main__":
    from omniloom.pretrain.cli import main

    sys.exit(main(["-qq", "export", *sys.argv[1:]]))
