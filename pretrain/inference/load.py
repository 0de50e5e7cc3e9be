"""Opening a model and its tokenizer from an export or a run folder."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 8192  # tokens: eval's pieces and generate's visual blocks when config.json records no seq_len
MAX_CONTEXT = 1 << 20  # the most source.seq_len an export's config.json may claim


def export_seq_len(export_dir: str | Path) -> int | None:
    """config.json's `source.seq_len`, the context the model trained with (None when not recorded:
    `save_export` without a run), checked: a whole number from 1 to MAX_CONTEXT."""
    from omniloom.model.pretrained import CONFIG_NAME, read_export_config

    seq_len = (read_export_config(export_dir).get("source") or {}).get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_CONTEXT):
        raise ValueError(f"{Path(export_dir) / CONFIG_NAME}: source.seq_len={seq_len!r} must be a whole number from 1 to "
                         f"{MAX_CONTEXT}; the file is corrupt or was not written by `omniloom export`")
    return seq_len


def check_visual_blocks_fit(tok, export_dir: str | Path, *, image: bool, video: bool) -> None:
    """Refuse, before any decoding, media whose largest block under the tokenizer's settings could
    not fit the model's context: training skips such blocks (the model never saw one), and the
    prompt's cost grows with them (a hostile omniloom_tokenizer.json with video_fps 240 and a frame
    budget of 2048, each in its range, made a 2 s clip a 15,000-token prompt: 2.1 GB)."""
    from omniloom.tokenizers.text import META_FILE

    seq_len = export_seq_len(export_dir)
    context = seq_len or DEFAULT_CONTEXT
    said = "source.seq_len in its config.json" if seq_len else "the default: its config.json records no source.seq_len"
    s = tok.settings
    for kind, wanted, need, keys in (("image", image, s.image_patch_budget + 2, "media.image_patch_budget"),
                                     ("video", video, s.max_video_patches + 2,
                                      "media.video_frame_budget or media.video_patch_budget")):
        if wanted and need > context:
            raise ValueError(f"{Path(export_dir) / META_FILE}: the largest {kind} block its settings allow ({need} tokens) "
                             f"is longer than the model's context ({context} tokens, {said}); lower {keys}")


def load_export_tokenizer(export_dir: str | Path, tokenizer: str | Path | None = None):
    """The Tokenizer of an export folder (or `tokenizer`, another folder, when given), refused
    unless it is the one the export was made with: `config.json` records its tokenizer.model's
    sha256, and a swapped tokenizer folder (both files replaced together, or `--tokenizer`
    pointing elsewhere) would give the model other ids without any other error. The export's own
    tokenizer files must not link out of the folder (as its weights must not). An export that
    records no hash (older omniloom) is not compared."""
    from omniloom.model.pretrained import _inside, read_export_config
    from omniloom.tokenizers.text import META_FILE, MODEL_FILE, SAVED_FILES, Tokenizer

    export_dir = Path(export_dir)
    want = (read_export_config(export_dir).get("tokenizer") or {}).get("model_sha256")
    src = Path(tokenizer) if tokenizer is not None else export_dir
    if tokenizer is None:
        for name in SAVED_FILES:
            if (export_dir / name).exists() or (export_dir / name).is_symlink():
                _inside(export_dir, export_dir / name)
    if tokenizer is None and not ((export_dir / MODEL_FILE).is_file() and (export_dir / META_FILE).is_file()):
        raise FileNotFoundError(
            f"{export_dir} holds no omniloom tokenizer ({MODEL_FILE} and {META_FILE}); a Hugging Face "
            f"save_pretrained folder carries them when the processor is saved too "
            f"(AutoProcessor.from_pretrained(EXPORT, trust_remote_code=True).save_pretrained(DIR)); otherwise copy "
            f"those two files from the export this model came from into {export_dir}, or pass --tokenizer EXPORT "
            "(checked against the sha256 config.json records). A tokenizer trained anew would give other ids")
    tok = Tokenizer.load(src)  # checks tokenizer.model against the folder's own recorded sha256 first
    got = tok.to_json()["model_sha256"]
    if want and got != want:
        raise ValueError(f"the tokenizer in {src} is not the one {export_dir / 'config.json'} was exported with "
                         f"(tokenizer.model sha256 {got[:12]}..., recorded {want[:12]}...); use the export's own "
                         "tokenizer files")
    return tok


def open_model(path: str | Path, *, device: str = "cpu", tokenizer: str | Path | None = None):
    """(model, Tokenizer, max_len) from an export folder or a run / checkpoint folder."""
    from omniloom.tokenizers.text import Tokenizer

    p = Path(path)
    if (p / "config.json").is_file():
        from omniloom.model.pretrained import load_pretrained

        seq_len = export_seq_len(p)
        tok = load_export_tokenizer(p, tokenizer)  # cheap, and checks the tokenizer before the model loads
        model = load_pretrained(p, device=device)
        return model, tok, seq_len
    from omniloom.pretrain.checkpoint.offline import load_checkpoint_model

    model, cfg, ckpt, tok_dir = load_checkpoint_model(p, tokenizer=tokenizer)
    log.info("evaluating checkpoint %s", ckpt)
    return model.to(device), Tokenizer.load(tok_dir), cfg.data.seq_len
