"""Data prep: `omniloom data build` and its tools, from raw files to shards.

    ingest.py      discover inputs, one input unit -> one validated document
    validate.py    text policy, JSONL layouts, fingerprints, paths kept inside their root
    media.py       image and video validation;  textenc.py  encodings;  html_doc.py  HTML pages
    shards.py      the deterministic, resumable shard writer;  merge.py  `data merge`
    inspect.py     `data inspect` / `verify`;  synth.py, demo_corpus.py  generated corpora
    build_bench.py `omniloom bench data build`

Imports the data root (manifest, outlock, progress, config), never data.stream.
"""
