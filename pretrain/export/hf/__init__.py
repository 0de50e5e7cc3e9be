"""Hugging Face interop of an export (issue 26): the remote code and JSON files `omniloom export`
writes beside the weights, so that `transformers` loads, runs, generates with and fine-tunes the
model without omniloom installed (docs/huggingface.md).

    remote_code.py   omniloom's own modules copied into the export, imports rewritten
    files.py         config.json keys, generation_config.json, processor_config.json
    remote/          the thin hand-written wrappers (shipped as package data, copied as they are)
"""
