"""Real pictures for `omniloom bench arch --corpus digits`: scikit-learn's handwritten digits.

The demo corpus's synthetic shapes are not enough to trust a conclusion about fusion. The one set
of real, labelled pictures that installs from a package registry with no download at run time is
scikit-learn's `load_digits` (1,797 handwritten digits, 8x8 grey levels 0-16, from the UCI
"Optical Recognition of Handwritten Digits" set, shipped inside the wheel). Each becomes a
document of one picture (upscaled to 64x64 RGB, nearest neighbour, so no pixel is invented) and
its caption, `a handwritten digit seven.`; `eval --captions` then scores exact captions, which is
classification accuracy against a majority baseline of about 10%. Every fifth digit is held out
(stratified by the order of the set), and the tokenizer's short prose sample gives the text-only
documents (training and held out) that the interference column needs.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _write_corpus(root: Path) -> None:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ValueError("bench arch --corpus digits needs scikit-learn (pip install scikit-learn): its handwritten "
                         "digits ship inside the package") from err
    import numpy as np
    from PIL import Image

    from omniloom.tokenizers.testing import SAMPLE_PROSE

    digits = load_digits()
    for part in ("train", "heldout", "text_train", "text_heldout"):
        (root / part).mkdir(parents=True, exist_ok=True)
    lines = {"train": [], "heldout": []}
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        part = "heldout" if i % 5 == 4 else "train"
        grey = np.clip(pixels * (255.0 / 16.0), 0, 255).astype(np.uint8)
        img = Image.fromarray(grey, mode="L").resize((64, 64), Image.NEAREST).convert("RGB")
        name = f"digit_{i:05d}.png"
        img.save(root / part / name)
        lines[part].append(json.dumps({"schema": 1, "segments": [
            {"type": "image", "ref": name}, {"type": "text", "text": f"a handwritten digit {WORDS[int(label)]}."}],
            "meta": {"source": f"sklearn-digits/{i}", "label": int(label)}}))
    for part, rows in lines.items():
        (root / part / "digits.jsonl").write_text("\n".join(rows) + "\n")
    prose = [line for line in SAMPLE_PROSE.splitlines() if line.strip()]
    for i, line in enumerate(prose):
        part = "text_heldout" if i % 5 == 4 else "text_train"
        (root / part / f"prose_{i:03d}.txt").write_text(line + "\n")
    (root / "README.txt").write_text(__doc__ or "")


def prepare_digits_data(out: Path, run, say=print) -> tuple[list[str], str, str]:
    """The digits corpus built once into OUT/data_digits: (training shard sets, held-out shards
    (digits, then text), tokenizer). `run(argv, log)` runs an omniloom command, 0 on success."""
    import shutil

    data = out / "data_digits"
    corpus, shards, tok = data / "corpus", data / "shards", data / "tokenizer"
    if not (corpus / "README.txt").exists():
        shutil.rmtree(corpus, ignore_errors=True)
        say("prepare: scikit-learn digits -> corpus")
        _write_corpus(corpus)
    for name in ("train", "heldout", "text_train", "text_heldout"):
        if not (shards / name / "manifest.json").exists():
            say(f"prepare: omniloom data build ({name})")
            shutil.rmtree(shards / name, ignore_errors=True)
            if run(["-qq", "data", "build", str(corpus / name), "--out", str(shards / name), "--name", name],
                   data / "log.txt") != 0:
                raise RuntimeError(f"bench arch: building {name} shards failed (see {data / 'log.txt'})")
    if not (tok / "omniloom_tokenizer.json").exists():
        say("prepare: omniloom tokenizer train")
        if run(["-qq", "tokenizer", "train", "--data", str(shards / "train"), str(shards / "text_train"),
                "--vocab-size", "512", "--image-patch-budget", "16", "--out", str(tok), "--force"], data / "log.txt") != 0:
            raise RuntimeError("bench arch: training the tokenizer failed")
    return ([f"{{path: {shards / 'train'}, weight: 4}}", f"{{path: {shards / 'text_train'}, weight: 1}}"],
            f"{shards / 'heldout'},{shards / 'text_heldout'}", str(tok))
