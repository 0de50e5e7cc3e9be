"""The run config: the tree of typed component configs a preset YAML loads into.

    run.py   RunConfig (model, data, optim, train, checkpoint, logging), presets, load_config,
             load_saved_config, what may differ on resume
    io.py    the machinery: YAML and dotted overrides into keyword-only dataclasses, ConfigError
    cli.py   `omniloom config show|list`

This package's face keeps `from omniloom.pretrain.config import RunConfig, load_config, ...`.
"""

from .io import ConfigError
from .run import (
                  CheckpointConfig,
                  LoggingConfig,
                  OptimConfig,
                  RunConfig,
                  TrainConfig,
                  list_accelerate_configs,
                  list_presets,
                  load_config,
                  load_saved_config,
                  presets_dir,
                  resolve_accelerate_config,
                  resolve_preset,
)

__all__ = ["CheckpointConfig", "ConfigError", "LoggingConfig", "OptimConfig", "RunConfig", "TrainConfig",
           "list_accelerate_configs", "list_presets", "load_config", "load_saved_config", "presets_dir",
           "resolve_accelerate_config", "resolve_preset"]
