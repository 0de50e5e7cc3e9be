"""Hugging Face processor of an omniloom export (written by `omniloom export`): text, images and
videos to exactly the model inputs omniloom's own tokenizer builds.

Each row is one document in omniloom's unified layout, built by omniloom's tokenize_document
(tokenizers_unified.py, a copy of omniloom's) with the export's tokenizer and media settings:
bos, then the segments, and no eos unless `eos=True` (a prompt to continue). The default layout
without `documents` is omniloom's prompt layout, the training stream's order: the images, then
the videos, then the text. Images: PIL images, uint8 pixel arrays, file paths or encoded bytes (a
path or bytes decodes exactly as `omniloom generate --image` does; a PIL image is taken as its
decoded pixels). Videos: file paths or bytes (sampled at the export's fps), or frames already
sampled (uint8 [F, H, W, 3] or a list of PIL images).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import BatchFeature
from transformers.processing_utils import ProcessorMixin

from .tokenizers_layout import SPECIAL
from .tokenizers_settings import MediaSettings
from .tokenizers_text import Tokenizer
from .tokenizers_unified import tokenize_document

INPUT_NAMES = ("input_ids", "attention_mask", "positions", "block_ids", "modality", "patches", "patch_kind")
# omniloom's own tokenizer files: save_pretrained carries them along, so that a folder saved here
# still works with `omniloom generate` / `eval` (config.json records the tokenizer.model's sha256)
OMNILOOM_TOKENIZER_FILES = ("tokenizer.model", "omniloom_tokenizer.json")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


class OmniloomProcessor(ProcessorMixin):
    def __init__(self, tokenizer=None, media: dict | None = None, chat_template=None):
        """`media`: omniloom's MediaSettings as JSON (processor_config.json holds the export's)."""
        self.media = dict(media or {})
        super().__init__(tokenizer, chat_template=chat_template)
        self.settings = MediaSettings.from_dict(self.media)
        self._tokenizer = Tokenizer(tokenizer, self.settings)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        proc = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        proc._omniloom_files = _omniloom_files(pretrained_model_name_or_path, kwargs)
        return proc

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Hugging Face's files, plus omniloom's tokenizer.model and omniloom_tokenizer.json from
        the folder this processor came from (copied first, so that push_to_hub uploads them too)."""
        import shutil

        files = getattr(self, "_omniloom_files", [])
        if files:
            Path(save_directory).mkdir(parents=True, exist_ok=True)
            for src in files:
                dst = Path(save_directory) / Path(src).name
                if not dst.exists() or not dst.samefile(src):
                    shutil.copyfile(src, dst)
        return super().save_pretrained(save_directory, *args, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return list(INPUT_NAMES)

    def __call__(self, images=None, text=None, videos=None, documents=None, eos: bool = False, padding_side: str = "left",
                 return_tensors: str = "pt", **kwargs) -> BatchFeature:
        """One row per document. `documents`: a list of documents, each a list of omniloom segments
        ({"type": "text", "text": ...}, {"type": "code", "lang": ..., "text": ...},
        {"type": "image", "image": ...}, {"type": "video", "video": ...}) or a doc.json object
        with "segments". Otherwise `text` (a string or a list, one per row), `images` and
        `videos` (one item, a list for one row, or a list of lists, one per row) in the prompt
        layout. Rows of different lengths are padded (`padding_side`, left by default, as
        generation wants). Returns input_ids, attention_mask, positions, block_ids, modality,
        patches, patch_kind as tensors."""
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if return_tensors != "pt":
            raise ValueError("the omniloom processor returns PyTorch tensors (return_tensors='pt')")
        if padding_side not in ("left", "right"):
            raise ValueError("padding_side must be 'left' or 'right'")
        docs = documents if documents is not None else self._prompt_documents(images, text, videos)
        tokenized = [self._tokenize(doc, i) for i, doc in enumerate(docs)]
        return BatchFeature(self._collate(tokenized, eos, padding_side))

    def _prompt_documents(self, images, text, videos) -> list[list[dict]]:
        texts = [text] if text is None or isinstance(text, str) else list(text)
        n = len(texts)
        per_row = []
        for kind, items in (("image", images), ("video", videos)):
            if items is None:
                per_row.append([[] for _ in range(n)])
            elif n > 1 or (isinstance(items, (list, tuple)) and items and isinstance(items[0], (list, tuple))):
                if len(items) != n:
                    raise ValueError(f"{len(items)} lists of {kind}s for {n} texts: give one list per text")
                per_row.append([list(x) if isinstance(x, (list, tuple)) else [x] for x in items])
            else:  # one row: one item or a list of them (a list of frames is a video: wrap it in a list)
                per_row.append([list(items) if isinstance(items, (list, tuple)) and kind == "image" else [items]])
        docs = []
        for t, imgs, vids in zip(texts, *per_row):
            segs = [{"type": "image", "image": x} for x in imgs] + [{"type": "video", "video": x} for x in vids]
            docs.append(segs + ([{"type": "text", "text": t}] if t else []))
        return docs

    def _tokenize(self, doc, row: int):
        segments = doc.get("segments") if isinstance(doc, dict) else doc
        if not isinstance(segments, list):
            raise ValueError(f"document {row}: a list of segments, or an object with 'segments'")
        out, media = [], {}
        for i, seg in enumerate(segments):
            kind = seg.get("type") if isinstance(seg, dict) else None
            if kind in ("image", "video") and kind in seg:
                ref = f"r{row}s{i}"
                value = seg[kind]
                media[ref] = Path(value).read_bytes() if isinstance(value, (str, Path)) else value
                seg = {"type": kind, "ref": ref}
            out.append(seg)
        return tokenize_document({"segments": out}, media, self._tokenizer, key=str(row))

    def _collate(self, docs, eos: bool, padding_side: str) -> dict:
        """Rows as the model's inputs: block ids numbered per row, patches in row-major order and
        zero-padded to the wider of the image and video patch widths (as omniloom's packed
        batches)."""
        width = max(self.settings.patch_dim, self.settings.tubelet_dim)
        lengths = [len(d) - (0 if eos else 1) for d in docs]
        S = max(lengths)
        pad = self.tokenizer.pad_token_id
        B = len(docs)
        out = {"input_ids": np.full((B, S), pad, np.int64), "attention_mask": np.zeros((B, S), np.int64),
               "positions": np.zeros((B, 3, S), np.int32), "block_ids": np.full((B, S), -1, np.int32),
               "modality": np.full((B, S), SPECIAL, np.uint8)}
        patches, kinds = [], []
        for b, (doc, L) in enumerate(zip(docs, lengths)):
            at = S - L if padding_side == "left" else 0
            cols = slice(at, at + L)
            out["input_ids"][b, cols] = doc.ids_L[:L]
            out["attention_mask"][b, cols] = 1
            out["positions"][b, :, cols] = doc.positions_3L[:, :L]
            out["modality"][b, cols] = doc.modality_L[:L]
            for n, blk in enumerate(sorted(doc.blocks, key=lambda blk: blk.start)):
                out["block_ids"][b, at + blk.start:at + blk.start + blk.length] = n
                rows = np.zeros((blk.length, width), np.float32)
                rows[:, :blk.patches_ND.shape[1]] = blk.patches_ND
                patches.append(rows)
                kinds.append(np.full(blk.length, blk.kind, np.uint8))
        tensors = {k: torch.from_numpy(v) for k, v in out.items()}
        tensors["patches"] = torch.from_numpy(np.concatenate(patches)) if patches else torch.zeros(0, width)
        tensors["patch_kind"] = torch.from_numpy(np.concatenate(kinds)) if kinds else torch.zeros(0, dtype=torch.uint8)
        return tensors


def _omniloom_files(name_or_path, kwargs: dict) -> list[str]:
    """The local paths of omniloom's tokenizer files for a folder or a Hub repo id ([] if absent)."""
    folder = Path(str(name_or_path))
    if folder.is_dir():
        sub = folder / kwargs["subfolder"] if kwargs.get("subfolder") else folder
        return [str(sub / n) for n in OMNILOOM_TOKENIZER_FILES if (sub / n).is_file()]
    from transformers.utils import cached_file

    found = []
    for name in OMNILOOM_TOKENIZER_FILES:
        try:
            path = cached_file(str(name_or_path), name, _raise_exceptions_for_missing_entries=False,
                               **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
        except OSError:
            path = None
        if path:
            found.append(path)
    return found
