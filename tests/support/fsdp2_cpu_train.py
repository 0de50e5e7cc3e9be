"""`python -m omniloom.pretrain.train` under FSDP2 on CPU over gloo, for the elastic-resume tests:
accelerate runs an FSDP config as plain data parallelism when there is no GPU, so this switches
its state to FSDP2 first (tests/support/ep_train_worker.py: fsdp2_on_cpu), then runs the trainer's CLI
with the arguments given. Launch it with `accelerate launch --config_file cpu_2proc.yaml`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("ep_train_worker", Path(__file__).with_name("ep_train_worker.py"))
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)

if __name__ == "__main__":
    _worker.fsdp2_on_cpu()
    from omniloom.pretrain.train.main import main

    sys.exit(main(sys.argv[1:]))
