"""The run config: the tree of component configs that a preset YAML loads into.

    RunConfig
      model: ModelConfig (attention, moe)    from omniloom.model.config
      data: DataConfig                       from omniloom.data.config
      optim, train, checkpoint, logging      here
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from omniloom.data.config import DataConfig
from omniloom.model.config import ModelConfig
from omniloom.pretrain.rundir import CHECKPOINT_CONFIG

from .io import ConfigError, Sources, apply_overrides, from_dict, load_yaml, to_yaml


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end

    def __post_init__(self) -> None:
        _at_least("optim", self, lr=0.0, weight_decay=0.0, grad_clip=0.0, warmup_steps=0)
        _at_least("optim", self, eps=1e-30)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:  # wsd decays over this share of the steps: none is no decay
            raise ValueError(f"optim.decay_fraction must be above 0 and at most 1, got {self.decay_fraction}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must each be in [0, 1), got {list(self.betas)}")


@dataclass(kw_only=True)
class TrainConfig:
    run_dir: str = "runs/default"
    num_steps: int = 1000
    grad_accum_steps: int = 1
    seed: int = 0
    deterministic: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    eval_every: int = 0
    eval_steps: int = 10
    max_bad_steps: int = 5  # non-finite loss/grad-norm steps in a row before the run stops
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # torch CPU threads per process; 0: cores // processes on this machine, less one per DataLoader
    # worker (pretrain/runtime/threads.py), unless OMP_NUM_THREADS is set
    num_threads: int = 0
    # glibc allocator policy on CPU: "keep" serves large tensors from the heap and never returns
    # freed memory to the OS, so a step does not page-fault its buffers in again every step
    # (pretrain/runtime/malloc.py); "default" leaves glibc as it is. Ignored on GPU runs.
    cpu_malloc: Literal["keep", "default"] = "keep"
    # DDP's per-step search for parameters without a gradient. OmniModel puts every parameter in
    # every step's graph (idle patch/tubelet projections and experts run as empty GEMMs), so it is
    # off; turn it on for a custom model that leaves parameters out of some steps.
    find_unused_parameters: bool = False
    # an export folder (`omniloom export`, or a Hugging Face save_pretrained of one) whose weights
    # start this run: weights only, the optimizer, schedule and data start fresh; ignored when
    # the run resumes from its own checkpoint (pretrain/train/init_from.py)
    init_from: str = ""

    def __post_init__(self) -> None:
        _at_least("train", self, num_steps=1, grad_accum_steps=1, eval_steps=1, max_bad_steps=1)
        _at_least("train", self, eval_every=0, num_threads=0)


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 500  # steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)
    keep_last: int = 3
    resume: str = ""  # "": fresh; "auto": newest complete checkpoint of run_dir, if any; or a step_N path
    # resuming on another number of processes: "keep" the checkpoint's global batch (processes x
    # batch_size x grad_accum_steps) by choosing the accumulation, refusing when none fits; "change":
    # train on with this run's own (pretrain/train/resume_batch.py)
    resume_global_batch: Literal["keep", "change"] = "keep"
    # what a resume does with the data stream: "exact" goes on where the checkpoint stopped and
    # refuses another data config; "keep_unchanged" lets data.sources change (added, removed,
    # reordered, reweighted: sources of the same name or path and sample count go on where they
    # were, the others start at their beginning); "restart" starts the data stream anew. The
    # model, optimizer, schedule and step resume in all three; the log says what the data did.
    resume_data: Literal["exact", "keep_unchanged", "restart"] = "exact"

    def __post_init__(self) -> None:
        _at_least("checkpoint", self, every=0, keep_last=1)


# logging.trackers: name -> the module its accelerate tracker imports (pretrain/train/trackers.py)
TRACKERS = {
    "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "aim": "aim", "comet_ml": "comet_ml",
    "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio",
}


@dataclass(kw_only=True)
class LoggingConfig:
    every: int = 10
    # Experiment trackers, started on rank 0 (pretrain/train/trackers.py): any of tensorboard, wandb,
    # mlflow, aim, comet_ml, clearml, dvclive, swanlab, trackio; [] for none. Each gets the run
    # config as hyperparameters and every scalar metric at every step, named `group/name`
    # (loss -> train/loss); metrics.jsonl is written either way.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "omniloom"  # the W&B project, the MLflow experiment, the others' project name
    run_name: str = ""  # the run's name in the trackers; "" = the run folder's name
    # Shorthand kept from before logging.trackers: false drops tensorboard from the trackers, true adds it.
    tensorboard: bool | None = None
    spike_window: int = 128
    spike_sigma: float = 6.0
    # without a terminal for the progress bar (launcher, pipe, log file): one progress line every N
    # seconds on rank 0 (step, loss, tokens/s, time left); 0: none
    progress_seconds: float = 30.0
    # Append, per rank and step, the documents trained on (source, epoch, sample, piece) to
    # RUN/data_trace/rankNNNNN.jsonl: an audit of exactly-once data, e.g. across a resume.
    data_trace: bool = False

    def __post_init__(self) -> None:
        _at_least("logging", self, every=1, spike_window=2, progress_seconds=0.0)
        _at_least("logging", self, spike_sigma=1e-30)
        if self.tensorboard is False:
            self.trackers = [t for t in self.trackers if t != "tensorboard"]
        elif self.tensorboard and "tensorboard" not in self.trackers:
            self.trackers = ["tensorboard", *self.trackers]
        self.tensorboard = None
        _check_trackers(self.trackers)


def _check_trackers(names: list[str]) -> None:
    """ValueError for an unknown or repeated tracker name (a typo fails here, at config time)."""
    seen = set()
    for name in names:
        if name not in TRACKERS:
            import difflib

            close = difflib.get_close_matches(str(name), list(TRACKERS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"logging.trackers: unknown tracker {name!r}{hint}; choose from {', '.join(TRACKERS)}, "
                             "or [] for none")
        if name in seen:
            raise ValueError(f"logging.trackers names {name!r} twice")
        seen.add(name)



def _at_least(section: str, obj, **minimum) -> None:
    """ValueError naming `section.key` for a value below its minimum (or NaN)."""
    for name, low in minimum.items():
        value = getattr(obj, name)
        if isinstance(value, float) and math.isnan(value) or value < low:
            bound = "> 0" if low == 1e-30 else f">= {low:g}"
            raise ValueError(f"{section}.{name} must be {bound}, got {value}")


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def presets_dir() -> Path:
    """The shipped presets (package data `omniloom.configs`, i.e. the repo's configs/)."""
    return Path(str(importlib.resources.files("omniloom.configs")))


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def resolve_preset(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a shipped preset (`tiny` -> configs/tiny.yaml)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    shipped = presets_dir() / f"{path.stem if path.suffix in ('.yaml', '.yml') else name_or_path}.yaml"
    if shipped.exists():
        return shipped
    import difflib

    names = list_presets()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"no config file or preset named '{name_or_path}' (presets: {', '.join(names)}){hint}")


def list_accelerate_configs() -> list[str]:
    """The shipped accelerate configs (configs/accelerate/NAME.yaml) by name."""
    return sorted(p.stem for p in (presets_dir() / "accelerate").glob("*.yaml"))


def resolve_accelerate_config(name_or_path: str) -> Path:
    """An accelerate config file that exists, else the shipped one of that name: `cpu_2proc`,
    `cpu_2proc.yaml` and `configs/accelerate/cpu_2proc.yaml` from any folder all name it."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = presets_dir() / "accelerate" / f"{path.stem if path.suffix in ('.yaml', '.yml') else path.name}.yaml"
    if shipped.is_file():
        return shipped
    import difflib

    names = list_accelerate_configs()
    close = difflib.get_close_matches(path.stem, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"--config_file {name_or_path}: no such file, and no shipped accelerate config of that name "
                      f"(shipped: {', '.join(names)}){hint}")


def load_config(preset: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a preset (name or YAML path) and apply dotted overrides; None means the defaults."""
    data, source = {}, None
    if preset:
        path = resolve_preset(preset)
        data, source = load_yaml(path), str(path)
    overridden: set[str] = set()
    data = apply_overrides(RunConfig, data, list(overrides or []), overridden)
    return from_dict(RunConfig, data, source=Sources(source, overridden))


def load_saved_config(path: str | Path) -> RunConfig:
    """The resolved config a checkpoint saved (its config.yaml). Keys added after it was written
    take the value that matches how it was trained, not today's default: a config without
    `model.rope_layout` trained with the `sections` layout."""
    from omniloom.model.config import LEGACY_ROPE_LAYOUT

    data = load_yaml(Path(path))
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and "rope_layout" not in model:
        data = {**data, "model": {**model, "rope_layout": LEGACY_ROPE_LAYOUT}}
    return from_dict(RunConfig, data, source=Sources(str(path), set()))


# model settings that no weight's shape records: resuming under other values would silently train
# another model on the checkpoint's weights
POSITION_KEYS = ("rope_layout", "rope_sections", "rope_base")


def config_differences(a, b, prefix: str = "model", ignore: frozenset[str] = frozenset()) -> list[tuple[str, object, object]]:
    """(dotted key, value in `a`, value in `b`) for every setting of the dataclass configs `a`
    and `b` (nested ones too) that differs; fields named in `ignore` are skipped."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            out += config_differences(x, y, f"{prefix}.{f.name}", ignore)
        elif f.name not in ignore and x != y:
            out.append((f"{prefix}.{f.name}", x, y))
    return out


def position_differences(trained, run) -> list[tuple[str, object, object]]:
    """(key, trained value, this run's value) for every POSITION_KEYS setting of the ModelConfig
    `trained` that the ModelConfig `run` changes."""
    return [(k, getattr(trained, k), getattr(run, k)) for k in POSITION_KEYS if getattr(trained, k) != getattr(run, k)]


def refuse_position_changes(trained, run, what: str) -> None:
    """ConfigError when `run` would rotate positions otherwise than `trained` (ModelConfigs) was
    trained: `what` (a checkpoint, an export) names the weights."""
    diff = position_differences(trained, run)
    if diff:
        fix = " ".join(f"model.{k}={_cli_value(a)}" for k, a, _ in diff)
        raise ConfigError(f"{what} was trained with " + ", ".join(f"model.{k}={_cli_value(a)}" for k, a, _ in diff)
                          + " but this run sets " + ", ".join(f"{_cli_value(b)}" for _, _, b in diff)
                          + f": positions would change under the trained weights; use {fix}")


def check_resume_positions(cfg: RunConfig, checkpoint: str | Path) -> None:
    """Refuse to resume `checkpoint` under position settings other than those it was trained
    with (a checkpoint from before `model.rope_layout` existed trained with `sections`)."""
    saved_path = Path(checkpoint) / CHECKPOINT_CONFIG
    if saved_path.is_file():  # the checkpoint checks report a checkpoint without its config
        refuse_position_changes(load_saved_config(saved_path).model, cfg.model, str(checkpoint))


def _cli_value(v) -> str:
    return "[" + ",".join(str(x) for x in v) + "]" if isinstance(v, (tuple, list)) else str(v)


__all__ = [
    "CheckpointConfig", "ConfigError", "check_resume_positions", "position_differences", "refuse_position_changes", "LoggingConfig", "OptimConfig", "RunConfig", "TrainConfig",
    "list_accelerate_configs", "list_presets", "load_config", "load_saved_config", "presets_dir", "resolve_accelerate_config",
    "resolve_preset", "to_yaml",
]
