"""Opening a model and its tokenizer from an export or a run folder."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


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
        from omniloom.model.pretrained import load_pretrained, read_export_config

        seq_len = (read_export_config(p).get("source") or {}).get("seq_len")
        tok = load_export_tokenizer(p, tokenizer)  # cheap, and checks the tokenizer before the model loads
        model = load_pretrained(p, device=device)
        return model, tok, seq_len
    from omniloom.pretrain.checkpoint.offline import load_checkpoint_model

    model, cfg, ckpt, tok_dir = load_checkpoint_model(p, tokenizer=tokenizer)
    log.info("evaluating checkpoint %s", ckpt)
    return model.to(device), Tokenizer.load(tok_dir), cfg.data.seq_len
