"""omniloom.pretrain: the CLI entry point, run configs, the accelerate trainer, checkpoints, export."""
