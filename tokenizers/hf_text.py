"""omniloom's text tokenizer over its Hugging Face `tokenizer.json` instead of SentencePiece: the
text tokenizer an export's processor uses (`omniloom export` copies this module into the export as
`tokenizers_text.py`, in place of tokenizers/text.py, whose SentencePiece the export's users need
not have; pretrain/export/hf/remote_code.py).

It gives omniloom's ids (the tokenizer.json contract of tokenizers/hf.py), with typed tag text
such as "<|image|>" kept as ordinary text as omniloom keeps it, and no bos/eos added: what
`tokenize_document` (tokenizers/unified.py) reads of a Tokenizer.
"""

from __future__ import annotations

import numpy as np

from omniloom.tokenizers.settings import MediaSettings, MediaSizes


class HFTextTokenizer(MediaSizes):
    """`encode`, `encode_array`, `decode`, `settings`, `patch_dim`, `tubelet_dim`, `vocab_size` over a
    transformers fast tokenizer loaded from an omniloom tokenizer.json."""

    def __init__(self, hf_tokenizer, settings: MediaSettings):
        self.hf = hf_tokenizer
        self.settings = settings

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids, specials: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=not specials)


# In the export this module is tokenizers_text.py, and the copies of omniloom's modules import
# `Tokenizer` from it (tokenize_document checks its tokenizer is one).
Tokenizer = HFTextTokenizer
