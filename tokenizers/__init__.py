"""omniloom.tokenizers: SentencePiece text/code tokenizer, image/video patch tokenizers, the unified layout.

Always imported as `omniloom.tokenizers`; a bare `import tokenizers` is Hugging Face's package.
Imports flow tokenizers <- data <- pretrain: nothing here imports omniloom.data.

Modules (public API):
    layout    TokenizedDoc, VisualBlock, modality codes, fixed special ids (BOS_ID, PATCH_ID, ...),
              validate_tokenized_doc
    settings  MediaSettings (patch sizes, budgets, fps, normalization), DocumentError, MediaError
    text      Tokenizer (= TextTokenizer): load/save, encode/decode, special_ids, settings;
              train_tokenizer(source, out_dir, vocab_size, ...)
    image     image_to_patches, patches_to_image, decode_image, fit_grid, frames_to_patches, patches_to_frames
    video     video_to_tubelets, tubelets_to_frames, decode_video, VideoInfo
    unified   tokenize_document(doc, media, tokenizer) -> TokenizedDoc, detokenize(tdoc, tokenizer)
    corpus    reading text/code segments straight from shard tars for training
    testing   make_tiny_tokenizer(tmp_dir), make_image_bytes, make_video_bytes (for tests)
    cli       `omniloom tokenizer train|encode|decode|show`, `omniloom bench tokenizers`
"""

if __name__ == "tokenizers":  # `import tokenizers` from the checkout's root found this folder: kernels/bare_import.py says what now
    import importlib.util as _util
    import os as _os

    _spec = _util.spec_from_file_location("_bare", _os.path.join(_os.path.dirname(_os.path.realpath(__file__)), "../kernels/bare_import.py"))
    _spec.loader.exec_module(_helper := _util.module_from_spec(_spec))
    _helper.hand_over(__name__, __file__)
