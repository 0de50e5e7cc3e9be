"""The Hugging Face files of an omniloom tokenizer: `tokenizer.json` (a fast tokenizer),
`tokenizer_config.json` and `special_tokens_map.json`, so that
`transformers.AutoTokenizer.from_pretrained(DIR)` works on a tokenizer or export folder.

The fast tokenizer is built from the SentencePiece model itself, with no dependency on
`tokenizers` or `transformers` here, and gives omniloom's ids exactly (tests/tokenizers/test_tokenizer_hf.py):

- model: BPE with byte fallback; the vocabulary is SentencePiece's pieces at their ids, and the
  merges are every split (a, b) of a learned piece into two learned pieces, ordered by the
  piece's score (SentencePiece's BPE merges the adjacent pair whose union scores highest, leftmost
  first; Hugging Face's merges the pair of lowest rank, leftmost first: the same order).
- whitespace: SentencePiece writes a space as U+2581 inside its pieces. The Hugging Face
  vocabulary spells those pieces with a real space instead, with no normalizer and no
  pre-tokenizer, so a literal U+2581 in the text is not a known character and falls back to its
  three byte pieces, as omniloom's Tokenizer.encode does (the one place where a bare SentencePiece
  encode differs). No dummy prefix, no whitespace collapsing: code keeps its spaces and tabs.
- decoder: byte fallback then fuse; decode(encode(s)) == s.
- specials: <unk> <s> </s> <pad> and the layout tags (<|image|> ... <|/code|>, the reserved
  slots) keep their fixed ids. Hugging Face matches special tokens in raw text by default, so
  "<|code|>" typed in a string becomes id 9, which is how a document with its tags written out
  tokenizes in omniloom's layout. omniloom itself treats typed tag text as ordinary text; pass
  `split_special_tokens=True` to `from_pretrained` (or the call) for that behaviour.
- no bos/eos are added (`add_bos_token`/`add_eos_token` false): `tokenizer(text).input_ids` equals
  `Tokenizer.encode(text)`; a document in the layout is `<s>` + ids + `</s>`.
"""

from __future__ import annotations

from omniloom.tokenizers import layout

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_MAP_FILE = "special_tokens_map.json"
HF_FILES = (HF_TOKENIZER_FILE, HF_CONFIG_FILE, HF_SPECIAL_MAP_FILE)
_WS = "\u2581"


def _spell(piece: str) -> str:
    return piece.replace(_WS, " ")


def fast_tokenizer_json(sp) -> dict:
    """The `tokenizer.json` object of a SentencePiece BPE processor (omniloom's trainer settings)."""
    n = int(sp.vocab_size())
    vocab: dict[str, int] = {}
    learned: list[tuple[float, int, str]] = []
    added = []
    for i in range(n):
        piece = sp.id_to_piece(i)
        spelled = piece if (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)) else _spell(piece)
        if spelled in vocab:
            raise ValueError(f"piece {piece!r} (id {i}) collides with id {vocab[spelled]} in the Hugging Face vocabulary")
        vocab[spelled] = i
        if sp.is_control(i) or sp.is_unknown(i):
            added.append({"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True})
        elif not sp.is_byte(i) and not sp.is_unused(i):
            learned.append((-float(sp.get_score(i)), i, spelled))
    mergeable = {p for _, _, p in learned}
    merges: list[list[str]] = []
    for _, _, piece in sorted(learned):
        splits = [(vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in mergeable and piece[k:] in mergeable]
        merges += [[a, b] for _, _, a, b in sorted(splits)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": layout.META_TOKENS[layout.UNK_ID],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def special_tokens_map() -> dict:
    return {
        "unk_token": layout.META_TOKENS[layout.UNK_ID],
        "bos_token": layout.META_TOKENS[layout.BOS_ID],
        "eos_token": layout.META_TOKENS[layout.EOS_ID],
        "pad_token": layout.META_TOKENS[layout.PAD_ID],
        "additional_special_tokens": list(layout.SPECIAL_TOKENS),
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map(),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def hf_files(sp) -> dict[str, dict]:
    """File name -> JSON object for the three Hugging Face files."""
    return {HF_TOKENIZER_FILE: fast_tokenizer_json(sp), HF_CONFIG_FILE: tokenizer_config(),
            HF_SPECIAL_MAP_FILE: special_tokens_map()}

