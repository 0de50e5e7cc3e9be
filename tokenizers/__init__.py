"""omniloom.tokenizers: SentencePiece text/code tokenizer, image/video patch tokenizers, the unified layout.

Always imported as `omniloom.tokenizers`; a bare `import tokenizers` is Hugging Face's package.
"""
