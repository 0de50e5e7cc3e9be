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

if __name__ == "tokenizers":  # `import tokenizers` from the checkout's root found this folder, not the real package
    # Hand the name over to the installed package of that name (what the importer meant), looking
    # past the checkout's root, so `python` started in the checkout can still use it (transformers
    # imports Hugging Face's `tokenizers`). omniloom itself is always `omniloom.tokenizers`.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None:
        del _sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r}: the {__name__}/ folder of the omniloom checkout "
                                  f"at {_root} is omniloom.{__name__}, not that package", name=__name__)
    _real = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _real
    try:
        _spec.loader.exec_module(_real)
    except BaseException:
        del _sys.modules[__name__]
        raise
