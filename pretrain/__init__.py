"""omniloom.pretrain: the CLI entry point, run configs, the accelerate trainer, checkpoints, export."""

# OpenMP reads its wait policy once, when torch loads it, so it is set here, before any of this
# package's modules imports torch: the `omniloom` command, `python -m omniloom.pretrain.train` and
# the ranks `omniloom launch` starts all come through this package first (pretrain/runtime/threads.py says
# why threads must sleep rather than spin while they wait on a shared machine).
from omniloom.pretrain.runtime.threads import apply_wait_policy as _apply_wait_policy

_apply_wait_policy()
