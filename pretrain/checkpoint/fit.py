"""Why a checkpoint does not fit this run's model, in one line: the first tensor whose shape (or
name) differs, both shapes, and the model settings that differ from the checkpoint's config.yaml.

torch (and torch.distributed.checkpoint) report another model shape as a multi-line load error,
which a resume used to show as "a file is unreadable"; `shape_mismatch` reads the tensor name and
both shapes out of it.
"""

from __future__ import annotations

import re
from pathlib import Path

from omniloom.pretrain.rundir import CHECKPOINT_CONFIG


class ShapeMismatch(ValueError):
    """The checkpoint's tensors have other shapes (or names) than this run's model."""

    def __init__(self, path, detail: str, changes: str = ""):
        self.path, self.detail = Path(path), detail
        super().__init__(f"cannot resume from {path}: {detail}{changes}; resume with the model config it was saved "
                         "with (its config.yaml), or start a new run")

    def explained(self, model_cfg) -> "ShapeMismatch":
        """The same error, saying which model settings differ from the checkpoint's config.yaml."""
        return ShapeMismatch(self.path, self.detail, model_config_changes(self.path, model_cfg))


_SIZE_RE = re.compile(r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                      r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_DCP_SIZE_RE = re.compile(r"Size mismatch between saved torch\.Size\((\[[^\]]*\])\) and current: "
                          r"torch\.Size\((\[[^\]]*\])\) for (\S+)")
_MISSING_RE = re.compile(r"Missing key\(s\) in state_dict: ([^\n]+)")
_UNEXPECTED_RE = re.compile(r"Unexpected key\(s\) in state_dict: ([^\n]+)")


def shape_mismatch(err: BaseException) -> str | None:
    """'the checkpoint's model differs from this run's: KEY is [a, b] there and [c, d] here (and N
    more)' from torch's or DCP's load error, or None when `err` is another error."""
    text = str(err)
    sizes = [(k, a, b) for k, a, b in _SIZE_RE.findall(text)]
    sizes += [(k.rstrip("."), a, b) for a, b, k in _DCP_SIZE_RE.findall(text)]
    if sizes:
        key, saved, here = sizes[0]
        more = f" (and {len(sizes) - 1} more tensor(s))" if len(sizes) > 1 else ""
        return (f"the checkpoint's model has other shapes than this run's: {key} is {saved} in the checkpoint and "
                f"{here} here{more}")
    for regex, where in ((_MISSING_RE, "is missing from the checkpoint"), (_UNEXPECTED_RE, "is in the checkpoint but "
                                                                                         "not in this run's model")):
        m = regex.search(text)
        if m:
            keys = [k.strip(' "\'.') for k in m.group(1).split(",") if k.strip(' "\'.')]
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            return f"the checkpoint's model differs from this run's: {keys[0]} {where}{more}"
    return None


def model_config_changes(path: str | Path, model_cfg) -> str:
    """' (model settings that differ from the checkpoint's config.yaml: model.dim 64 there, 128
    here; ...)', or '' when config.yaml is unreadable or agrees."""
    from omniloom.pretrain.config.run import config_differences, load_saved_config

    try:
        saved = load_saved_config(Path(path) / CHECKPOINT_CONFIG).model
    except Exception:  # noqa: BLE001 - only a hint on an error path
        return ""
    diff = [f"{k} {a!r} there, {b!r} here" for k, a, b in config_differences(saved, model_cfg)]
    if not diff:
        return ""
    more = f"; and {len(diff) - 4} more" if len(diff) > 4 else ""
    return f" (settings that differ from its config.yaml: {'; '.join(diff[:4])}{more})"
