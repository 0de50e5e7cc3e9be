"""omniloom's text tokenizer (omniloom/tokenizers/text.py) as the export's processor needs it,
over the export's Hugging Face tokenizer.json instead of SentencePiece: it gives omniloom's ids
(the tokenizer.json contract of omniloom/tokenizers/hf.py), with typed tag text such as
"<|image|>" kept as ordinary text as omniloom keeps it, and no bos/eos added."""

from __future__ import annotations

import numpy as np

from .tokenizers_settings import MediaSettings


class Tokenizer:
    """`encode`, `encode_array`, `decode`, `settings`, `patch_dim`, `tubelet_dim`, `vocab_size`:
    what omniloom's tokenize_document (tokenizers_unified.py) reads of a Tokenizer."""

    def __init__(self, hf_tokenizer, settings: MediaSettings):
        self.hf = hf_tokenizer
        self.settings = settings

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def patch_dim(self) -> int:
        return self.settings.patch_dim

    @property
    def tubelet_dim(self) -> int:
        return self.settings.tubelet_dim

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids, specials: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=not specials)
